import json

import pytest


@pytest.fixture(scope="module")
def host_ops(load_benchmark):
    return load_benchmark("host_ops")


def test_counts_the_loops_ops_outside_the_steps(host_ops, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    host_ops.main(["--tiny", "--tokens", "48"])
    result = json.loads((tmp_path / "host_ops.json").read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"ar", "longspec"} and all(row["tokens"] == 48 for row in rows.values())
    # A plain round outside its step: its host copy only (on the CPU a clone taken at launch, as the GPU's pinned
    # copy is: the step's outputs are overwritten by its next call), plus the call's own start-up (prefill logits,
    # first token) spread over the tokens. Before the plain round's tree was kept, building it (and aligning a mask
    # the one token never reads) added seven: 9.5 per token at 48 tokens; before the round's commit moved into its
    # step, the cache's length update added one more (3.7).
    assert rows["ar"]["ops_per_token"] < 3
    assert "aten::add_" not in rows["ar"]["top_ops_per_token"]  # lengths.add_(counts): inside the step now
    assert rows["ar"]["top_ops_per_token"]["aten::clone"] == pytest.approx(1.0, abs=0.05)  # the host copy


def test_steps_are_unmarked_afterwards(host_ops):
    call = host_ops.graphs.StaticStep.__call__
    with host_ops.marked_steps():
        assert host_ops.graphs.StaticStep.__call__ is not call
    assert host_ops.graphs.StaticStep.__call__ is call
