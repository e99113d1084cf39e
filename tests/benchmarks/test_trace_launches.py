import gzip
import json

import pytest


@pytest.fixture(scope="module")
def trace_launches(load_benchmark):
    return load_benchmark("trace_launches")


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_groups_are_cut_at_idle_gaps(trace_launches, tmp_path, capsys):
    """Two graph launches of three kernels each (back to back inside, 10 µs apart), a host-side event that is no
    device work, and a copy: three groups, the kernels counted by their short names."""
    events = [
        _kernel("void at::native::vectorized_elementwise_kernel<4, at::native::Foo>(int)", 0.0, 1.0),
        _kernel("_gemv_kernel", 1.5, 3.0),
        _kernel("_gemv_kernel", 5.0, 3.0),
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 6.0, "dur": 50.0},
        _kernel("_gemv_kernel", 18.0, 3.0),
        _kernel("_split_kv_partial_kernel", 21.5, 4.0),
        _kernel("_split_kv_reduce_kernel", 26.0, 2.0),
        _kernel("Memcpy DtoH (Device -> Pinned)", 40.0, 1.5, cat="gpu_memcpy"),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = trace_launches.main([str(path)])
    assert [row["kernels"] for row in rows] == [3, 3, 1]
    assert rows[0]["names"] == {"_gemv_kernel": 2, "vectorized_elementwise_kernel": 1}
    assert rows[0]["span_us"] == pytest.approx(8.0) and rows[0]["busy_us"] == pytest.approx(7.0)
    assert rows[1]["span_us"] == pytest.approx(10.0)
    trace_launches.main([str(path), "--show", "1"])
    shown = capsys.readouterr().out.splitlines()[-3:]
    assert [line.split()[-1] for line in shown] == [
        "_gemv_kernel",
        "_split_kv_partial_kernel",
        "_split_kv_reduce_kernel",
    ]


def test_a_trace_without_device_work_is_one_clear_error(trace_launches, tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]})
    )
    with pytest.raises(SystemExit, match="no device kernels"):
        trace_launches.main([str(path)])
