"""The end-to-end orchestrator (longspec.e2e): its plan, resume logic, glue and report; a real mini run (slow)."""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import pytest

from longspec import e2e
from longspec.e2e import PRESETS, Step, apply_overrides, plan, run_pipeline


def _cmd(step: Step) -> list[str]:
    assert step.cmd is not None, step.name
    return step.cmd


def test_cpu_plan_chains_the_three_stages(tmp_path):
    steps = plan(PRESETS["cpu"], str(tmp_path))
    names = [s.name for s in steps]
    assert names == [
        "corpus", "data_stage1", "data_stage2", "stage3_prompts", "stage3_regenerate", "data_stage3",
        "train_stage1", "export_stage1", "train_stage2", "export_stage2", "train_stage3", "export_stage3", "eval",
    ]  # fmt: skip
    by_name = {s.name: s for s in steps}
    for index in (1, 2, 3):
        train = _cmd(by_name[f"train_stage{index}"])
        assert train[1:3] == ["-m", "torch.distributed.run"] and "longspec.train" in train
        assert f"stage=tiny_stage{index}" in train
        assert by_name[f"train_stage{index}"].env == {"DS_ACCELERATOR": "cpu"}
        init = [a for a in train if a.startswith("init_from=")]
        # each stage starts from the previous stage's export; stage 1 from scratch
        assert init == ([] if index == 1 else [f"init_from={tmp_path}/runs/stage{index - 1}/export"])
    assert "--keep-unfinished" in _cmd(by_name["data_stage3"])
    assert f"drafter.path={tmp_path}/runs/stage3/export" in _cmd(by_name["eval"])
    # the regenerated continuations are what stage 3 trains on
    assert _cmd(by_name["data_stage3"])[_cmd(by_name["data_stage3"]).index("--source") + 1] == str(
        tmp_path / "data" / "stage3_regenerated.jsonl"
    )


def test_plan_overrides_validate_against_the_train_and_eval_schemas(tmp_path):
    """The Hydra overrides the plan writes compose into valid TrainConfig / EvalConfig objects."""
    from longspec.eval.config import load_eval_config
    from longspec.train.config import load_config

    steps = {s.name: s for s in plan(PRESETS["cpu"], str(tmp_path))}
    for index in (1, 2, 3):
        os.makedirs(tmp_path / "runs" / f"stage{index}" / "export")
    for index in (1, 2, 3):
        train = _cmd(steps[f"train_stage{index}"])
        cfg = load_config(train[train.index("longspec.train") + 1 :])
        assert cfg.stage.name == f"tiny_stage{index}"
        assert cfg.drafter.window == PRESETS["cpu"].window
        assert cfg.stage.position_ids == ("anchor_offset" if index == 1 else "plain")
        assert cfg.stage.flash_noisy
        assert cfg.max_steps == getattr(PRESETS["cpu"], f"stage{index}").num_steps
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "heldout_lcc.jsonl").write_text("")
    ev = _cmd(steps["eval"])
    cfg = load_eval_config(ev[ev.index("longspec.eval") + 1 :])
    assert cfg.methods == list(PRESETS["cpu"].evals[0].methods)
    assert cfg.temperature == 0 and cfg.max_new_tokens == PRESETS["cpu"].eval_max_new_tokens


def test_smollm2_plan_converts_the_gguf_and_evaluates_the_suite(tmp_path):
    data = tmp_path / "data_in"
    gguf = str(tmp_path / "model.gguf")
    preset = apply_overrides(PRESETS["smollm2"], [f"target_gguf={gguf}"])
    steps = {s.name: s for s in plan(preset, str(tmp_path / "out"), data=str(data))}
    assert "corpus" not in steps and "stage3_prompts" not in steps  # prepared elsewhere and carried
    convert = _cmd(steps["convert_target"])
    assert convert[convert.index("longspec.convert_gguf") + 1] == gguf
    target = convert[convert.index("longspec.convert_gguf") + 2]
    assert f"--tokenizer {target}" in " ".join(_cmd(steps["data_stage1"]))  # its tokenizer comes with it
    assert str(data / "corpus" / "long_docs.jsonl") in _cmd(steps["data_stage2"])
    regenerate = _cmd(steps["stage3_regenerate"])
    assert regenerate[regenerate.index("--template") + 1] == "chat"
    assert regenerate[regenerate.index("--source") + 1] == str(data / "stage3_prompts.jsonl")
    assert steps["train_stage1"].env == {}  # DeepSpeed on the GPU
    for name in ("eval_t0_graphs", "eval_t1_graphs"):
        cmd = _cmd(steps[name])
        assert any(a.startswith("data.name=[") and "qmsum_8k.jsonl" in a for a in cmd)
        assert "cuda_graphs=true" in cmd and not any(a.startswith("tree_widths=") for a in cmd)  # tree=auto
    assert "temperature=1.0" in _cmd(steps["eval_t1_graphs"])
    # the GPU runs the target's stage-3 responses while stage 1 trains, and tokenizes stage 3 while stage 2 trains
    order = list(steps)
    assert steps["stage3_regenerate"].background and steps["data_stage3"].background
    assert order.index("stage3_regenerate") + 1 == order.index("train_stage1")
    assert order.index("data_stage3") + 1 == order.index("train_stage2")
    with pytest.raises(ValueError, match="--data"):
        plan(preset, str(tmp_path / "out"))


def test_apply_overrides():
    preset = apply_overrides(
        PRESETS["cpu"], ["stage1.num_steps=5", "eval_max_samples=1", "tree_widths=2,2", "window=32"]
    )
    assert preset.stage1.num_steps == 5 and preset.eval_max_samples == 1
    assert preset.tree_widths == (2, 2) and preset.window == 32
    assert PRESETS["cpu"].stage1.num_steps != 5  # the registry is untouched
    with pytest.raises(ValueError, match="unknown preset field"):
        apply_overrides(PRESETS["cpu"], ["stage1.no_such_field=1"])
    with pytest.raises(ValueError, match="name=value"):
        apply_overrides(PRESETS["cpu"], ["window"])


def _echo_step(name: str, out_file: str, text: str) -> Step:
    code = f"open({out_file!r}, 'w').write({text!r}); print('step 1/1 | wrote')"
    return Step(name=name, cmd=[sys.executable, "-c", code], outputs=[out_file])


def test_run_pipeline_resumes_and_reruns_from_the_first_changed_step(tmp_path, capsys):
    out = str(tmp_path)
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    steps = [_echo_step("first", a, "1"), _echo_step("second", b, "2")]
    assert run_pipeline(steps, out) == {"first": "done", "second": "done"}
    assert open(a).read() == "1" and open(b).read() == "2"
    assert "$ python -c" in capsys.readouterr().out  # the command is printed before it runs
    # same plan, outputs present -> nothing runs
    assert run_pipeline(steps, out) == {"first": "skipped", "second": "skipped"}
    # a changed command reruns that step and every later one (their inputs may have changed)
    steps2 = [_echo_step("first", a, "1b"), _echo_step("second", b, "2")]
    assert run_pipeline(steps2, out) == {"first": "done", "second": "done"}
    # a missing output reruns its step
    os.remove(b)
    assert run_pipeline(steps2, out) == {"first": "skipped", "second": "done"}
    manifest = json.loads((tmp_path / e2e.MANIFEST_NAME).read_text())
    assert manifest["steps"]["second"]["status"] == "done"
    assert (tmp_path / "logs" / "02_second.log").read_text().startswith("$ ")


def test_run_pipeline_dry_run_and_failures(tmp_path, capsys):
    out = str(tmp_path)
    a = str(tmp_path / "a.txt")
    assert run_pipeline([_echo_step("first", a, "1")], out, dry_run=True) == {"first": "planned"}
    assert not os.path.exists(a)
    failing = Step(name="boom", cmd=[sys.executable, "-c", "raise SystemExit('bad input')"], outputs=[a])
    optional = Step(name="opt", cmd=failing.cmd, outputs=[a], required=False)
    assert run_pipeline([optional, _echo_step("after", a, "x")], out) == {"opt": "failed", "after": "done"}
    assert "bad input" in capsys.readouterr().out  # the log's tail is shown
    with pytest.raises(SystemExit, match="step boom failed"):
        run_pipeline([failing], out, force=True)


def test_write_prefix_prompts(tmp_path):
    texts = [f"# file {i}\n" + "".join(f"x_{i}_{j} = {j}\n" for j in range(200)) for i in range(5)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"text": t, "path": f"m{i}.py"}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "p" / "prompts.jsonl"
    assert e2e.write_prefix_prompts(str(train), str(out), num_prompts=3, max_chars=500) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and len({r["id"] for r in rows}) == 3
    for row in rows:
        context = row["context"]
        assert 0 < len(context) <= 500 and not context.endswith("\n")
        assert any(t.startswith(context + "\n") for t in texts)  # a prefix cut at a line end


def test_results_table_and_report(tmp_path):
    preset = PRESETS["cpu"]
    (tmp_path / "eval").mkdir()
    summary = {
        "heldout_lcc": {
            "longspec": {"mean_accept_length": 2.5, "tokens_per_s": 30.0, "speedup": {"vanilla_hf": 1.5},
                         "identical_to_greedy": 1.0, "mean_prompt_len": 1500, "num_samples": 3},
            "vanilla_hf": {"mean_accept_length": 1.0, "tokens_per_s": 20.0, "speedup": {},
                           "identical_to_greedy": 1.0, "mean_prompt_len": 1500, "num_samples": 3},
        },
        # every sample degenerate: the headline is empty, the table falls back to all samples, marked; longspec
        # slower than plain decoding says why
        "looping": {
            "longspec": {"mean_accept_length": None, "tokens_per_s": None, "speedup": {}, "num_samples": 0,
                         "num_degenerate": 2, "identical_to_greedy": 1.0,
                         "all_samples": {"mean_accept_length": 1.1, "tokens_per_s": 18.0, "mean_prompt_len": 900,
                                         "trees": {"ar": 45, "1": 5}}},
            "vanilla_hf": {"mean_accept_length": None, "tokens_per_s": None, "speedup": {}, "num_samples": 0,
                           "num_degenerate": 2, "identical_to_greedy": 1.0,
                           "all_samples": {"mean_accept_length": 1.0, "tokens_per_s": 20.0, "mean_prompt_len": 900}},
        },
    }  # fmt: skip
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"summary": summary}))
    rows = e2e.eval_rows(str(tmp_path), preset)
    table = e2e.results_table(rows)
    assert "| longspec | 3 | 2.50 | 30.0 | 1.50x | yes |" in table
    assert "| longspec | 0 (+2 degenerate) | 1.10* | 18.0* | 0.90x* | yes |" in table
    assert "eval / looping: longspec at 0.90x of vanilla_hf" in table and "in 90% of rounds" in table
    run_dir = tmp_path / "runs" / "stage1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 9.0 - s, "ce": 5.0 - s, "acc": 0.1 * s, "tokens_seen": 100 * s})
            + "\n"
            for s in (1, 2)
        )
    )
    text = e2e.write_report(str(tmp_path), preset, plan(preset, str(tmp_path)), {}, 12.0)
    assert "| 1 | 2 | 200 | 4.000 | 3.000 | 20.0% |" in text
    assert (tmp_path / "report.md").exists() and (tmp_path / "training_loss.png").exists()
    assert json.loads((tmp_path / "e2e_summary.json").read_text())["eval"][0]["tau"] == 2.5


@pytest.mark.slow
@pytest.mark.distributed
def test_mini_run_end_to_end(tmp_path):
    """The whole pipeline through the real CLIs at toy sizes (2 training steps per stage, 8 new tokens)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    train_files = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "abc.py", "bisect.py", "heapq.py"]
    with open(corpus / "train.jsonl", "w") as f:
        for name in train_files:
            f.write(json.dumps({"text": open(os.path.join(stdlib, name)).read(), "path": name}) + "\n")
    context = open(os.path.join(stdlib, "textwrap.py")).read()[:2500]
    cut = context.rfind("\n") + 1
    row = {"_id": "t", "input": "", "context": context[:cut], "answers": ["x"], "dataset": "lcc"}
    (corpus / "heldout_lcc.jsonl").write_text(json.dumps(row) + "\n")
    sets = [
        "stage1_max_rows=6", "stage2_max_rows=6", "stage2_min_tokens=64", "num_prompts=4", "prompt_chars=400",
        "regen_max_new_tokens=8", "eval_max_new_tokens=8", "eval_max_samples=1", "eval_min_prompt_tokens=100",
        "tree_widths=2,2", "window=16",
        "stage1.seq_len=64", "stage1.num_steps=2", "stage1.global_batch_size=4", "stage1.micro_batch_size=2",
        "stage2.seq_len=128", "stage2.num_steps=2", "stage2.global_batch_size=4", "stage2.micro_batch_size=2",
        "stage3.seq_len=256", "stage3.num_steps=2", "stage3.global_batch_size=4", "stage3.micro_batch_size=2",
    ]  # fmt: skip
    out = tmp_path / "out"
    argv = ["--preset", "cpu", "--out", str(out), "--data", str(tmp_path / "data")]
    argv += [a for s in sets for a in ("--set", s)]
    assert e2e.main(argv) == 0
    summary = json.loads((out / "e2e_summary.json").read_text())
    methods = {r["method"]: r for r in summary["eval"]}
    assert set(methods) == {"longspec", "vanilla_hf", "ar", "pld"}
    assert all(r["identical"] == 1 for r in methods.values())  # lossless at T=0
    assert methods["longspec"]["tau"] >= 1.0
    assert [s["steps"] for s in summary["training"]] == [2, 2, 2]
    assert (out / "report.md").exists() and (out / "training_loss.png").exists()
    # rerun: everything is skipped, the report is rewritten
    assert e2e.main(argv) == 0
    manifest = json.loads((out / e2e.MANIFEST_NAME).read_text())
    assert all(record["status"] == "done" for record in manifest["steps"].values())


def test_preset_validation_runs_once_on_the_final_preset(tmp_path):
    # an intermediate state (batch below micro-batch x processes) is fine while --set applies one field at a time
    preset = apply_overrides(PRESETS["cpu"], ["stage1.global_batch_size=2", "stage1.micro_batch_size=1"])
    assert plan(preset, str(tmp_path))
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        plan(apply_overrides(PRESETS["cpu"], ["stage1.global_batch_size=3"]), str(tmp_path))


def test_stage3_sft_keeps_cut_continuations_without_eos(tmp_path):
    """The e2e's stage 3 trains on target continuations cut at --max-new-tokens: kept with --keep-unfinished,
    and not closed by an EOS they never had; finished rows still end with EOS."""
    from transformers import AutoTokenizer

    from data_prep.stage3_sft import prepare_stage3_sft
    from longspec.data.shards import ShardReader

    tokenizer = AutoTokenizer.from_pretrained(e2e.CODE_TARGET)
    rows = [
        {"context": "def f(x):", "response": "    return x + 1", "finished": False},
        {"context": "import os", "response": "\nimport sys", "finished": True},
    ]
    src = tmp_path / "regen.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for keep, kept in ((False, 1), (True, 2)):
        out = tmp_path / f"keep_{keep}"
        manifest = prepare_stage3_sft(
            source=str(src), tokenizer=tokenizer, out=str(out), template="plain", keep_unfinished=keep,
            progress=False,
        )  # fmt: skip
        assert manifest.rows["kept"] == kept
    reader = ShardReader(tmp_path / "keep_True")
    responses = [reader.row(i)[0][reader.row(i)[1]].tolist() for i in range(len(reader))]
    assert responses[0][-1] != tokenizer.eos_token_id
    assert tokenizer.decode(responses[0]) == "    return x + 1"
    assert responses[1][-1] == tokenizer.eos_token_id
