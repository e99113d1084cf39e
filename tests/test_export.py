"""`python -m longspec.export`: a run's checkpoint -> a self-contained drafter dir that loads onto its target only."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from longspec.cli import UserError
from longspec.drafter import Drafter, DrafterConfig
from longspec.export import export_drafter, find_checkpoint, main
from longspec.testing import build_byte_tokenizer, make_tiny_target


def _fake_run(tmp_path, target, tokenizer, steps=(2, 4)):
    """A run dir as the trainer writes it (checkpoints/step_N/{drafter/, trainer_state.json})."""
    run = tmp_path / "run"
    drafters = {}
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        torch.manual_seed(step)
        drafter = Drafter(
            DrafterConfig.from_target_config(target.config, window=8, tokenizer=tokenizer),
            target.embed_tokens,
            target.lm_head,
        )
        drafter.save_pretrained(ckpt / "drafter")
        state = {
            "step": step,
            "total_steps": 4,
            "tokens_seen": 1000 * step,
            "stage": "tiny_stage1",
            "target": {"name": "tiny_llama", "path": "/x"},
            "data": {"path": "/d", "rows": 9, "seq_len": 64},
        }
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
        drafters[step] = drafter
    (run / "checkpoints" / ".tmp-step_00000006").mkdir()  # an interrupted save: ignored
    return run, drafters


def test_export_round_trip_and_wrong_target(tmp_path):
    tokenizer = build_byte_tokenizer()
    target = make_tiny_target("llama")
    run, drafters = _fake_run(tmp_path, target, tokenizer)
    out = tmp_path / "export"
    main([str(run), str(out)])
    assert sorted(p.name for p in out.iterdir()) == [
        ".longspec",
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert "tiny_llama" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["target_fingerprint"]["tokenizer_sha256"]
    weights = load_file(out / "model.safetensors")
    assert not any(k.startswith(("embed", "lm_head")) for k in weights)  # the block only

    loaded = Drafter.from_pretrained(out, target, tokenizer)  # the latest step (4)
    for key, value in drafters[4].state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.shared_storage_ok(target)

    with pytest.raises(ValueError, match="does not match this target"):
        Drafter.from_pretrained(out, make_tiny_target("qwen2"), tokenizer)

    export_drafter(str(run), str(tmp_path / "older"), step=2, dtype="bfloat16")
    older = load_file(tmp_path / "older" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in older.values())


def test_export_mistakes_are_clear(tmp_path):
    target = make_tiny_target("llama")
    run, _ = _fake_run(tmp_path, target, build_byte_tokenizer(), steps=(2,))
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        find_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="available: \\[2\\]"):
        find_checkpoint(str(run), 7)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    for overwrite in (False, True):  # not an export: never deleted
        with pytest.raises(FileExistsError, match="not written by longspec"):
            export_drafter(str(run), str(tmp_path / "busy"), overwrite=overwrite)
    assert (tmp_path / "busy" / "file").read_text() == "x"
    export_drafter(str(run), str(tmp_path / "done"))
    export_drafter(str(run), str(tmp_path / "done"), overwrite=True)  # a previous export is replaced
    empty = tmp_path / "empty_run"
    (empty / "checkpoints" / ".tmp-step_00000001").mkdir(parents=True)  # a save in flight: not a checkpoint
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        find_checkpoint(str(empty))


def test_exported_and_checkpointed_weights_follow_the_umask(tmp_path):
    # safetensors 0.8 writes 0o600 whatever the umask: an export (and a checkpoint's drafter) must be readable
    # by the rest of a shared cluster as any other file the run writes.
    import os
    import stat

    old = os.umask(0o022)
    try:
        run, _ = _fake_run(tmp_path, make_tiny_target("llama"), build_byte_tokenizer(), steps=(2,))
        main([str(run), str(tmp_path / "export")])
    finally:
        os.umask(old)
    for path in (run / "checkpoints" / "step_00000002" / "drafter" / "model.safetensors",
                 tmp_path / "export" / "model.safetensors"):  # fmt: skip
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_export_refuses_a_config_the_loader_would_refuse(tmp_path):
    # A checkpoint config.json that parses but is no drafter config (a field of the wrong type, no checksums to
    # catch it) was exported, and only Drafter.from_pretrained of the export failed.
    run, _ = _fake_run(tmp_path, make_tiny_target("llama"), build_byte_tokenizer(), steps=(2,))
    config = run / "checkpoints" / "step_00000002" / "drafter" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "64"}))
    with pytest.raises(UserError, match="not a valid drafter config .*hidden_size"):
        export_drafter(str(run), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_carries_the_draft_vocabulary(tmp_path):
    """A drafter trained over a draft vocabulary exports its id map beside the weights (its hash in config.json and
    the card); a checkpoint that lost the map is refused before anything is written."""
    from longspec.drafter.vocab import DRAFT_VOCAB_NAME, DraftVocab

    tokenizer = build_byte_tokenizer()
    target = make_tiny_target("llama")
    run, drafters = _fake_run(tmp_path, target, tokenizer, steps=(2,))
    vocab = DraftVocab(torch.arange(0, target.config.vocab_size, 3), target.config.vocab_size)
    drafters[2].use_draft_vocab(vocab)
    source = run / "checkpoints" / "step_00000002" / "drafter"
    drafters[2].save_pretrained(source)
    out = tmp_path / "export"
    main([str(run), str(out)])
    assert (out / DRAFT_VOCAB_NAME).is_file()
    assert vocab.fingerprint() in (out / "README.md").read_text()
    loaded = Drafter.from_pretrained(out, target, tokenizer)
    assert torch.equal(loaded.draft_vocab.ids, vocab.ids)

    (source / DRAFT_VOCAB_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="trained over a draft vocabulary of"):
        export_drafter(str(run), str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()
