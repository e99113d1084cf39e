import json

import pytest
import torch


@pytest.fixture(scope="module")
def decode_methods(load_benchmark):
    return load_benchmark("decode_methods")


def test_smoke_preset_times_every_cpu_method(decode_methods, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = decode_methods.main(["--preset", "smoke", "--vocab-size", "256", "--contexts", "48", "--tokens", "4",
                                "--repeats", "2"])  # fmt: skip
    saved = json.loads((tmp_path / "decode_methods.json").read_text())["rows"]
    assert saved == rows
    # ar_graphs needs CUDA: without it the four others run, each repeat timed
    graphs = ["ar_graphs"] if torch.cuda.is_available() else []
    assert [r["method"] for r in rows] == ["vanilla_hf", "vanilla_fa", "hf_compile", "ar", *graphs]
    for row in rows:
        assert row["context"] == 48 and len(row["tokens_per_s"]) == 2
        assert all(speed > 0 for speed in row["tokens_per_s"])


def test_longspec_with_tree_auto(decode_methods):
    rows = decode_methods.main(["--preset", "smoke", "--vocab-size", "256", "--contexts", "48", "--tokens", "6",
                                "--repeats", "1", "--methods", "longspec", "--window", "16"])  # fmt: skip
    (row,) = rows
    assert row["method"] == "longspec" and row["tokens_per_s"][0] > 0
    assert sum(row["trees"].values()) >= 1  # which trees tree=auto ran


def test_profile_reports_where_a_token_goes(decode_methods, tmp_path, monkeypatch):
    """--profile: one more run under torch.profiler per method, with wall and device-busy time per token, the top
    host ops and a gzipped Chrome trace in $OUT (on a CPU the device-busy time is 0: there is no device)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = decode_methods.main(["--preset", "smoke", "--vocab-size", "256", "--contexts", "48", "--tokens", "6",
                                "--repeats", "1", "--methods", "ar", "--profile"])  # fmt: skip
    profile = rows[0]["profile"]
    assert profile["wall_ms_per_token"] > 0 and profile["device_busy_ms_per_token"] >= 0
    assert profile["top_host_ops"] and all(op["calls"] > 0 for op in profile["top_host_ops"])
    assert profile["top_device_kernels"] == []  # no device kernels on the CPU
    assert (tmp_path / "trace_ar_48.json.gz").stat().st_size > 0


def test_host_profile_reports_the_hosts_python_per_token(decode_methods):
    """--host-profile: one more run under cProfile per method: the functions with the most own host time per
    token, the engine's round loop among them."""
    rows = decode_methods.main(["--preset", "smoke", "--vocab-size", "256", "--contexts", "48", "--tokens", "6",
                                "--repeats", "1", "--methods", "ar", "--host-profile"])  # fmt: skip
    functions = rows[0]["host_profile"]
    assert 0 < len(functions) <= 25
    own = [f["own_us_per_token"] for f in functions]
    assert own == sorted(own, reverse=True) and own[0] > 0
    assert all(f["cumulative_us_per_token"] >= f["own_us_per_token"] - 1e-6 for f in functions)
    profiled = " ".join(f["function"] for f in functions)
    assert "engine.py" in profiled or "target.py" in profiled, profiled


def test_device_kernels_keeps_kernels_only_per_token(decode_methods):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, count, device_us):
        return SimpleNamespace(
            key=key, device_type=device_type, count=count, self_device_time_total=device_us
        )

    events = [
        event("aten::mm", DeviceType.CPU, 90, 9000.0),  # a host op (its kernels counted): left out
        event("_split_kv_reduce_kernel", DeviceType.CUDA, 300, 6000.0),
        event("_split_kv_partial_kernel", DeviceType.CUDA, 300, 1500.0),
    ]
    rows = decode_methods.device_kernels(events, tokens=10)
    assert [r["kernel"] for r in rows] == ["_split_kv_reduce_kernel", "_split_kv_partial_kernel"]
    assert rows[0] == {"kernel": "_split_kv_reduce_kernel", "calls_per_token": 30.0, "us_per_call": 20.0,
                       "ms_per_token": 0.6}  # fmt: skip


def test_a_saved_target_and_drafter_decode_a_data_sources_prompt(decode_methods, tmp_path, monkeypatch):
    """--target / --drafter / --data: the real pair's weights (the drafter loaded fingerprint-checked against the
    target) on the end of an evaluation data source's prompt; --data without --target is refused."""
    from longspec.drafter import Drafter, DrafterConfig
    from longspec.target import TargetModel
    from longspec.testing import build_byte_tokenizer, save_tiny_target

    target_dir = save_tiny_target("llama", tmp_path / "target")
    target = TargetModel.from_pretrained(target_dir)
    drafter_config = DrafterConfig.from_target_config(
        target.config, window=16, tokenizer=build_byte_tokenizer()
    )
    Drafter(drafter_config, target.embed_tokens, target.lm_head).save_pretrained(tmp_path / "drafter")
    data = tmp_path / "rows.jsonl"
    row = {"_id": "r0", "context": "Meeting: we ship on Monday. " * 6, "input": "When?", "answers": ["Monday"],
           "dataset": "qmsum"}  # fmt: skip
    data.write_text(json.dumps(row) + "\n")
    used = []
    real = decode_methods.data_prompts
    monkeypatch.setattr(decode_methods, "data_prompts", lambda *a: used.append(real(*a)) or used[-1])
    loaded = []
    real_load = Drafter.from_pretrained
    monkeypatch.setattr(Drafter, "from_pretrained", lambda *a, **k: loaded.append(a[0]) or real_load(*a, **k))
    rows = decode_methods.main(["--target", target_dir, "--drafter", str(tmp_path / "drafter"), "--data",
                                str(data), "--contexts", "48", "--tokens", "6", "--repeats", "1", "--methods",
                                "ar", "pld", "longspec", "--tree", "1"])  # fmt: skip
    assert loaded == [str(tmp_path / "drafter")]
    assert len(used) == 1 and len(used[0][0]) == 48  # one context: the data's prompt end, 48 tokens
    assert [r["method"] for r in rows] == ["ar", "pld", "longspec"]
    assert all(r["tokens_per_s"][0] > 0 for r in rows) and rows[2]["trees"]
    # eager rounds time their phases: the drafter's chain drafts, a plain step does not
    phases = {r["method"]: r["phase_ms_per_round"] for r in rows}
    assert all(set(p) == {"draft", "verify", "commit"} and p["verify"] > 0 for p in phases.values())
    assert phases["longspec"]["draft"] > phases["ar"]["draft"]
    with pytest.raises(SystemExit):
        decode_methods.main(["--preset", "smoke", "--data", str(data), "--contexts", "48"])


def test_several_drafters_run_round_robin_on_one_target(decode_methods, tmp_path, monkeypatch):
    """--drafter A=DIR B=DIR: each longspec method once per drafter (rows `longspec@A`, `longspec@B`, labelled),
    the target-only methods once and unlabelled; the repeats go round-robin over the rows; two drafters under
    one label are refused."""
    from longspec.drafter import Drafter, DrafterConfig
    from longspec.target import TargetModel
    from longspec.testing import build_byte_tokenizer, save_tiny_target

    target_dir = save_tiny_target("llama", tmp_path / "target")
    target = TargetModel.from_pretrained(target_dir)
    for name, window in (("a", 16), ("b", 8)):
        config = DrafterConfig.from_target_config(
            target.config, window=window, tokenizer=build_byte_tokenizer()
        )
        Drafter(config, target.embed_tokens, target.lm_head).save_pretrained(tmp_path / name)
    order = []
    real = decode_methods.run_method
    monkeypatch.setattr(
        decode_methods, "run_method", lambda method, *a, engine, **k: order.append((method, id(engine)))
        or real(method, *a, engine=engine, **k),
    )  # fmt: skip
    rows = decode_methods.main(["--target", target_dir, "--drafter", f"A={tmp_path / 'a'}", str(tmp_path / "b"),
                                "--contexts", "32", "--tokens", "4", "--repeats", "2", "--methods", "ar",
                                "longspec", "--tree", "1"])  # fmt: skip
    assert [r["method"] for r in rows] == ["ar", "longspec@A", "longspec@b"]
    assert "drafter" not in rows[0] and [r["drafter"] for r in rows[1:]] == ["A", "b"]
    assert all(len(r["tokens_per_s"]) == 2 and set(r["trees"]) == {"1"} for r in rows[1:])
    # round-robin: ar, A, b, ar, A, b; the two drafters on their own engines
    assert [m for m, _ in order] == ["ar", "longspec", "longspec"] * 2
    assert order[1][1] != order[2][1] and order[1][1] == order[4][1]
    with pytest.raises(SystemExit, match="its own label"):
        decode_methods.main(["--target", target_dir, "--drafter", str(tmp_path / "a"), f"a={tmp_path / 'b'}",
                             "--contexts", "32", "--tokens", "4", "--methods", "longspec"])  # fmt: skip
