import json

import pytest


@pytest.fixture(scope="module")
def batch_throughput(load_benchmark):
    return load_benchmark("batch_throughput")


def test_tiny_mode_writes_a_complete_table(batch_throughput, tmp_path, monkeypatch, capsys):
    """Batch 1 and 2 on CPU with the stand-in drafter accepting depth 1 always and depth 2 never: τ = 2 exactly
    (tree 2,2,2; 8 tokens = the prefill's + 7 in rounds of 2, the last round's extra token truncated).
    vanilla_fa decodes 5 tokens per row (--vanilla-fa-tokens), checked against ar's first 5."""
    monkeypatch.setenv("OUT", str(tmp_path))
    batch_throughput.main(["--tiny", "--accept-profile", "1,0", "--vanilla-fa-tokens", "5"])
    result = json.loads((tmp_path / "batch_throughput.json").read_text())
    assert result["accept_profile"] == [1.0, 0.0] and result["expected_tau"] == 2.0
    assert result["tree_widths"] == [2, 2, 2] and result["vanilla_fa"] == "batched, the same prompts"
    assert [(r["context"], r["batch"]) for r in result["rows"]] == [(40, 1), (40, 2)]
    for row in result["rows"]:
        for key in ("ar_tok_s", "longspec_tok_s", "vanilla_fa_tok_s"):
            assert row[key] > 0, key
        assert row["speedup"] == pytest.approx(row["longspec_tok_s"] / row["ar_tok_s"])
        assert row["speedup_vs_vanilla_fa"] == pytest.approx(row["longspec_tok_s"] / row["vanilla_fa_tok_s"])
        assert row["vanilla_fa_rows_equal_ar"] == row["batch"] and "ar_tokens" not in row  # fp32: all equal
        assert row["vanilla_fa_tokens"] == 5
        # the script's own check: every sequence's longspec output == its ar output
        assert row["lossless"] == [True] * row["batch"] and row["longspec_matches_ar"]
        assert row["divergences"] == [] and row["near_ties_only"] and row["explained_only"]
        assert row["tau"] == 2.0 and row["tokens_per_row"] == [8] * row["batch"]
    assert result["all_lossless"]
    out = capsys.readouterr().out
    assert "| context | batch | AR tok/s | LongSpec tok/s | LongSpec/AR |" in out


def test_timed_runs_build_no_steps(batch_throughput, tmp_path, monkeypatch):
    """Nothing is built (with graphs: captured) inside a timed run, for either method: the cell reserves the
    cache both runs need before the warm-ups (ar's timed run used to reallocate it and re-capture its step), and
    a batch whose rows reach max_new_tokens a few rounds apart does not shrink into a new bucket near the end
    (GenerationConfig.shrink_min_tokens)."""
    from longspec.infer import graphs

    built, timing = [], [False]
    init, generate_batch = graphs.StaticStep.__init__, batch_throughput.SpeculativeEngine.generate_batch

    def counting(self, *args, **kwargs):
        built.append(timing[0])
        init(self, *args, **kwargs)

    def timed_generate(self, prompts, config, **kwargs):  # timed: the runs of the full length
        timing[0] = config.max_new_tokens == 120
        return generate_batch(self, prompts, config, **kwargs)

    monkeypatch.setattr(graphs.StaticStep, "__init__", counting)
    monkeypatch.setattr(batch_throughput.SpeculativeEngine, "generate_batch", timed_generate)
    monkeypatch.setenv("OUT", str(tmp_path))
    args = [
        "--tiny",
        "--accept-profile",
        "0.9,0.8,0.7",
        "--tree",
        "auto",
        "--batch-sizes",
        "4",
        "--tokens",
        "120",
    ]
    batch_throughput.main([*args, "--no-vanilla-fa"])
    assert built and not any(built)  # steps were built, in the warm-ups only


def test_expected_tau(batch_throughput):
    assert batch_throughput.expected_tau([1.0, 0.5], 3) == 2.5  # 1 + 1 + 0.5; depth 3 accepts nothing
    assert batch_throughput.expected_tau([0.8] * 10, 2) == pytest.approx(1 + 0.8 + 0.64)


def test_stand_in_follows_the_slots_when_the_batch_shrinks(batch_throughput):
    """Rows 0 and 1 reach an EOS early, the batch of 4 shrinks to 2 and rows 2 and 3 move to slots 0 and 1: with a
    profile that always accepts, their rounds keep accepting the whole depth, which they can only do if the
    stand-in's references moved with them (before the fix, they read rows 0 and 1's references and accepted
    nothing). The margin target makes the CPU run's greedy text robust, as on the GPU."""
    import torch

    from longspec.drafter import Drafter, DrafterConfig
    from longspec.infer.engine import GenerationConfig, SpeculativeEngine

    class Args:
        tiny, target, shape = True, None, "8b"

    target = batch_throughput.build_target(Args, torch.device("cpu"), torch.float32)
    assert "perm(x)" in batch_throughput.give_greedy_margin(target, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    config = DrafterConfig.from_target_config(target.config, window=8)
    drafter = batch_throughput.ProfileDrafter(
        Drafter(config, target.embed_tokens, target.lm_head).requires_grad_(False),
        [1.0, 1.0, 1.0],
        max_len=128,
    )
    engine = SpeculativeEngine(target, drafter)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, target.vocab_size, (30 + 2 * row,), generator=generator).tolist() for row in range(4)
    ]
    plain = GenerationConfig(max_new_tokens=32, static_shapes=True, tree_widths=(2, 2, 2))
    ar = engine.generate_batch(prompts, plain, method="ar")
    # The EOS: rows 0 and 1's first token (after 2) that rows 2 and 3 never write.
    others = set(ar[2].tokens + ar[3].tokens)
    stops = [next(i for i in range(2, 32) if ar[row].tokens[i] not in others) for row in (0, 1)]
    assert max(stops) < 8  # the batch shrinks early: rows 2 and 3 run several rounds in their new slots
    eos = tuple(ar[row].tokens[i] for row, i in zip((0, 1), stops, strict=True))
    references = [p + r.tokens for p, r in zip(prompts, ar, strict=True)]
    config = GenerationConfig(
        max_new_tokens=32, static_shapes=True, tree_widths=(2, 2, 2), eos_token_ids=eos, shrink_min_tokens=0
    )
    # The script's path: a warm-up run (which shrinks the batch too), then the timed run, each from the
    # references of the full batch.
    spec, _ = batch_throughput.timed_batch(
        engine, prompts, config, "longspec", 1, before=lambda: drafter.set_references(references)
    )
    assert [len(r.tokens) for r in spec] == [stops[0] + 1, stops[1] + 1, 32, 32]  # 0, 1 stop at their EOS
    for row in (2, 3):
        assert spec[row].tokens == ar[row].tokens
        # 31 tokens after the prefill's: 7 rounds of 4 (the whole depth accepted), then the last round's 3
        assert spec[row].stats.accepted == [3] * 8, spec[row].stats.accepted


def test_the_profile_is_measured_from_an_eval_results_file(batch_throughput, tmp_path):
    """--accept-profile RESULTS.json: P(depth d accepted | d-1 was) pooled over the longspec rounds of the samples
    whose reference is real text; a looping sample (which a drafter predicts perfectly) does not count."""
    import random

    from longspec.eval.summary import summarise

    real = random.Random(0).sample(range(1000), 100)  # 100 distinct tokens: real text to the quality guard

    def record(sample_id, output, reached, accepted):
        return {"id": sample_id, "prompt_len": 100, "output_ids": output, "num_new_tokens": len(output),
                "rounds": reached[0], "accepted": [1] * accepted[0], "decode_s": 1.0, "draft_s": 0.0,
                "verify_s": 0.0, "overhead_s": 0.0, "depth_reached": reached, "depth_accepted": accepted}  # fmt: skip

    methods = {
        "ar": {"d": [record(0, real, [0], [0]), record(1, [5] * 100, [0], [0])]},
        "longspec": {
            "d": [record(0, real, [10, 8, 4], [8, 4, 0]), record(1, [5] * 100, [10, 10, 10], [10, 10, 10])],
            "e": [record(0, real, [10, 5, 0], [5, 0, 0])],  # depth 3 never reached here
        },
    }
    results = {"methods": methods, "summary": summarise(methods, greedy=True)}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))  # the keys of "quality" become strings, as in a real file
    assert batch_throughput.measured_profile(str(path)) == [13 / 20, 4 / 13, 0.0]
    with pytest.raises(SystemExit, match="no pld rounds"):
        batch_throughput.measured_profile(str(path), method="pld")


def test_tree_auto_cells_record_the_trees_run(batch_throughput, tmp_path, monkeypatch):
    """--tree auto: the adaptive policy (round costs measured at the cell's batch size) decodes each cell; the
    outputs still equal AR's, the rounds per tree are recorded, and so are the round costs it weighed (the
    warm-up's table at that batch size) and the times it observed for the trees it ran."""
    monkeypatch.setenv("OUT", str(tmp_path))
    result = batch_throughput.main(
        ["--tiny", "--tree", "auto", "--accept-profile", "1,1", "--batch-sizes", "2"]
    )
    assert result["tree_widths"] == "auto" and result["all_lossless"]
    (row,) = result["rows"]
    assert sum(row["trees"].values()) > 0 and row["tokens_per_row"] == [8, 8]
    candidates = {"ar", "1", "1-1", "1-1-1-1", "2-2-2", "4-4-4", "4-8-8-8", "4-16-16-16", "4-16-16-16-16",
                  "lookup2", "lookup4", "lookup8", "lookup16", "lookup16x2", "lookup16x4"}  # fmt: skip
    assert set(row["trees"]) <= candidates
    table = row["round_costs_ms"]
    assert {key.split(":")[1] for key in table} == candidates
    assert min(table.values()) > 0
    # the trees run in this cell's calls (warm-up included), by context bucket
    observed = row["observed_round_ms"]
    assert observed and set(observed) <= set(table) and min(observed.values()) > 0


def test_the_margin_makes_a_random_targets_greedy_choice_survive_bf16(batch_throughput):
    """Why random targets get `give_greedy_margin`: their logits are flat, so bf16 and fp32 greedy already
    disagree at some of 256 positions; with the margin they agree everywhere, by gaps far above bf16's rounding
    step at those logits (<= 0.0625 below 16)."""
    import torch
    from shapes import random_target  # beside batch_throughput.py, on sys.path once it is loaded
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=16384, tie_word_embeddings=False,
    )  # fmt: skip
    ids = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1))
    for margin in (False, True):
        target = random_target(config, "cpu", torch.float32)
        if margin:
            batch_throughput.give_greedy_margin(target, torch.Generator().manual_seed(0))
        with torch.no_grad():
            fp32 = target.model(ids).logits[0]
            bf16 = target.model.to(torch.bfloat16)(ids).logits[0].float()
        differ = (fp32.argmax(-1) != bf16.argmax(-1)).sum().item()
        top2 = fp32.topk(2, dim=-1).values
        if not margin:
            assert differ > 0  # flat logits: rounding alone changes the text
        else:
            assert differ == 0 and fp32.max() < 16 and (top2[:, 0] - top2[:, 1]).min() > 50 * 0.0625


def test_data_prompts_are_the_ends_of_real_prompts(batch_throughput, tmp_path, monkeypatch):
    """--data: each row is the end of an evaluation data source's prompt (built and tokenized as the eval does),
    row b context - 3 b tokens, cycling through the prompts long enough; the table records where prompts came
    from, and a source with no prompt that long is refused with the longest length."""
    from longspec.eval.datasets import load_samples
    from longspec.target_source import load_tokenizer
    from longspec.testing import save_tiny_target

    tokenizer_dir = save_tiny_target("llama", tmp_path / "tok")
    data = tmp_path / "rows.jsonl"
    rows = [{"_id": f"r{i}", "context": f"Meeting {i}: we ship on Monday. " * 4, "input": "When?",
             "answers": ["Monday"], "dataset": "qmsum"} for i in range(2)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, _ = load_samples(
        str(data), load_tokenizer(tokenizer_dir), context_len=10**6, min_prompt_tokens=0, context_margin=0
    )
    documents = [s.prompt_ids for s in samples]
    prompts = batch_throughput.data_prompts(documents, 40, 3)
    assert [len(p) for p in prompts] == [40, 37, 34]
    assert (
        prompts[0] == documents[0][-40:]
        and prompts[1] == documents[1][-37:]
        and prompts[2] == documents[0][-34:]
    )
    with pytest.raises(SystemExit, match=f"the longest has {max(map(len, documents))}"):
        batch_throughput.data_prompts(documents, 10**5, 1)

    monkeypatch.setenv("OUT", str(tmp_path))
    used = []  # the cells' prompts: the data's, never random ones
    monkeypatch.setattr(batch_throughput, "prompts_for", lambda *a: pytest.fail("random prompts with --data"))
    real = batch_throughput.data_prompts
    monkeypatch.setattr(batch_throughput, "data_prompts", lambda *a: used.append(real(*a)) or used[-1])
    args = ["--tiny", "--accept-profile", "1,0", "--no-vanilla-fa", "--batch-sizes", "2"]
    batch_throughput.main([*args, "--data", str(data), "--tokenizer", tokenizer_dir])
    assert used == [real(documents, 40, 2)]
    result = json.loads((tmp_path / "batch_throughput.json").read_text())
    assert result["prompts"] == f"data: {data}" and result["all_lossless"]
    with pytest.raises(SystemExit, match="--data needs the target's tokenizer"):
        batch_throughput.main([*args, "--data", str(data)])
