"""Trainer pieces that need no process group: schedule, data checks, metrics truncation, RNG and checkpoint
bookkeeping, and the training module's losses against a full-logits reference."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from longspec.data.loader import IGNORE_INDEX
from longspec.data.manifest import Manifest, tokenizer_fingerprint
from longspec.drafter import Drafter, DrafterConfig
from longspec.testing import build_byte_tokenizer, make_tiny_target
from longspec.train.build import cosine_with_warmup
from longspec.train.checkpoint import CheckpointManager, rng_state, set_rng_state
from longspec.train.config import load_config
from longspec.train.metrics import truncate_metrics
from longspec.train.model import DraftingModel
from longspec.train.preflight import check_data


def test_cosine_with_warmup():
    f = cosine_with_warmup(total_steps=20, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert [f(0), f(1)] == [0.5, 1.0]  # warmup of 2 steps, the first step already trains
    assert f(2) == pytest.approx(1.0) and f(19) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 17 / 18))
    )
    assert all(f(s) >= f(s + 1) for s in range(1, 19))


def _manifest(**kw):
    base = dict(
        stage="stage1",
        source="s",
        seq_len=64,
        packed=True,
        has_loss_mask=False,
        token_dtype="uint16",
        tokenizer=tokenizer_fingerprint(build_byte_tokenizer()),
        complete=True,
    )
    return Manifest(**{**base, **kw})


def test_check_data_refuses_mismatched_data(tmp_path):
    cfg = load_config(
        ["stage=tiny_stage1", "target=tiny_llama", f"target.path={tmp_path}", f"data.path={tmp_path}"]
    )
    tokenizer = build_byte_tokenizer()
    check_data(_manifest(), cfg, tokenizer)
    with pytest.raises(ValueError, match="packed rows of 32 tokens but stage.seq_len is 64"):
        check_data(_manifest(seq_len=32), cfg, tokenizer)
    with pytest.raises(ValueError, match="--max-len 64"):
        check_data(_manifest(seq_len=128, packed=False), cfg, tokenizer)
    with pytest.raises(ValueError, match="another tokenizer"):
        check_data(_manifest(tokenizer={"sha256": "0" * 64}), cfg, tokenizer)


def test_build_model_resolves_anchor_max_len(tmp_path):
    """Where the target's context is known, stage.anchor_max_len becomes a number: derived from it (tiny: 4096
    positions), an explicit value kept, one above the context an error."""
    from longspec.positions import default_max_len
    from longspec.testing import save_tiny_target
    from longspec.train.build import build_model

    target = save_tiny_target("llama", tmp_path / "target")
    base = ["stage=tiny_stage1", "target=tiny_llama", f"target.path={target}", f"data.path={tmp_path}"]

    def built(*extra: str) -> int:
        cfg = load_config([*base, *extra])
        build_model(cfg, {}, dtype=torch.float32, device=torch.device("cpu"), rank=0, tokenizer=None)
        return cfg.stage.anchor_max_len

    assert built() == default_max_len(4096) == 3750
    assert built("stage.anchor_max_len=4096") == 4096
    with pytest.raises(
        ValueError, match=r"stage.anchor_max_len \(4097\) exceeds the target's context \(4096 "
    ):
        built("stage.anchor_max_len=4097")


def test_truncate_metrics_drops_redone_steps_and_partial_lines(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "lo')
    truncate_metrics(str(tmp_path), 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:2]) + "\n"


def test_rng_state_round_trip_is_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_checkpoint_bookkeeping_ignores_temp_dirs_not_damaged_ones(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=2, rank=0)
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    (root / ".tmp-step_00000010").mkdir()  # a save in flight or killed: never a checkpoint
    assert manager.latest() == str(root / "step_00000006")
    # A step_* dir is renamed into place whole: one without trainer_state.json was damaged later, and is the
    # latest all the same (the resume then refuses it by name instead of silently taking step 6).
    (root / "step_00000008").mkdir()
    assert manager.latest() == str(root / "step_00000008")
    manager._prune()
    assert sorted(p.name for p in root.iterdir()) == [
        ".tmp-step_00000010",
        "step_00000006",
        "step_00000008",
    ]
    manager.remove_partial()
    assert not (root / ".tmp-step_00000010").exists()


@pytest.mark.parametrize(
    "family", ["qwen2", "qwen3-moe", "phi3-longrope", "phi4-mini"]
)  # MoE, fused projections + LongRoPE, partial rope
@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_drafting_model_losses_match_full_logits(distill_weight, family):
    target = make_tiny_target(family)
    drafter = Drafter(
        DrafterConfig.from_target_config(target.config, window=4), target.embed_tokens, target.lm_head
    )
    model = DraftingModel(
        target, drafter, distill_weight=distill_weight, loss_backend="chunked", chunk_size=7
    )
    ids = torch.randint(0, 256, (2, 13))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    positions = torch.arange(13).expand(2, 13)
    valid_rows = (labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(-1)
    out = model(ids, positions, labels, valid_rows, lag=2)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters()}
    drafter.zero_grad()

    # Reference: full logits, plain torch.
    t = target(ids, positions)
    hidden = drafter(ids, positions, t.last_k, t.last_v, lag=2)
    logits = drafter.logits(hidden).float()
    mask = labels != IGNORE_INDEX
    ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="sum")
    kl = (
        (
            F.softmax(target.logits(t.hidden).float(), -1)
            * (F.log_softmax(target.logits(t.hidden).float(), -1) - F.log_softmax(logits, -1))
        )
        .sum(-1)[mask]
        .sum()
    )
    (ce + distill_weight * kl).backward()
    assert out.ce_sum.item() == pytest.approx(ce.item(), rel=1e-5)
    assert out.num_correct.item() == int((logits.argmax(-1) == labels)[mask].sum())
    if distill_weight:
        assert out.kl_sum.item() == pytest.approx(kl.item(), rel=1e-4)
    for key, param in drafter.named_parameters():
        torch.testing.assert_close(grads[key], param.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in target.parameters())  # the target stays frozen


def test_metrics_logger_fans_out_and_formats_one_line(tmp_path, caplog):
    from longspec.train.metrics import JsonlSink, MetricsLogger, format_line

    class ListSink:
        def __init__(self):
            self.records, self.closed = [], False

        def write(self, step, record):
            self.records.append((step, record))

        def close(self):
            self.closed = True

    record = {
        "loss": 2.5,
        "acc": 0.25,
        "grad_norm": 1.0,
        "lr": 1e-4,
        "tokens_per_s": 12345.0,
        "mem_gb": 3.0,
        "step_time_s": 0.5,
        "total_steps": 10,
    }
    fake = ListSink()
    logger = MetricsLogger([fake, JsonlSink(str(tmp_path / "metrics.jsonl"))], log_every=1)
    logger.log(3, record)
    logger.close()
    assert fake.records == [(3, record)] and fake.closed
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, **record}
    line = format_line(3, record)
    assert line.startswith("step 3/10 | loss 2.5000 | acc 0.250 | gnorm 1.000 | lr 1.00e-04 | tok/s 12,345")


def test_wandb_sink_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from longspec.train.metrics import WandbSink

    monkeypatch.delenv(
        "WANDB_MODE", raising=False
    )  # conftest disables W&B; this test asks for offline explicitly
    sink = WandbSink(
        mode="offline", project="longspec-test", name="t", run_dir=str(tmp_path), config={"seed": 0}
    )
    sink.write(1, {"loss": 2.0})
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_drafting_model_losses_over_a_draft_vocabulary(distill_weight):
    """With a draft vocabulary the loss is CE / KL over the head's rows of its ids: labels by draft id, a position
    whose label lies outside it carries no loss, the teacher's distribution renormalised over those ids."""
    from longspec.drafter.vocab import DraftVocab

    target = make_tiny_target("llama")
    drafter = Drafter(
        DrafterConfig.from_target_config(target.config, window=4), target.embed_tokens, target.lm_head
    )
    ids = torch.randint(0, 256, (2, 13))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    # the draft vocabulary: half the labels' ids and 30 others, so some labels lie outside it
    inside = labels[labels != IGNORE_INDEX].unique()[::2]
    extra = torch.tensor([i for i in range(256) if i not in set(labels.view(-1).tolist())][:30])
    vocab = DraftVocab(torch.cat([inside, extra]).sort().values, 256)
    drafter.use_draft_vocab(vocab, head=False)
    model = DraftingModel(
        target, drafter, distill_weight=distill_weight, loss_backend="chunked", chunk_size=5
    )
    positions = torch.arange(13).expand(2, 13)
    valid_rows = (labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(-1)
    out = model(ids, positions, labels, valid_rows, lag=1)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters()}
    drafter.zero_grad()

    t = target(ids, positions)
    hidden = drafter(ids, positions, t.last_k, t.last_v, lag=1)
    logits = target.logits(hidden).float()[..., vocab.ids]  # [B, T, Kd]
    draft_labels = vocab.target_to_draft()[labels.clamp(min=0)]
    keep = (labels != IGNORE_INDEX) & (draft_labels >= 0)
    assert 0 < keep.sum() < (labels != IGNORE_INDEX).sum()  # labels inside and outside
    ce = F.cross_entropy(logits[keep], draft_labels[keep], reduction="sum")
    teacher = target.logits(t.hidden).float()[..., vocab.ids]
    kl = (
        (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(logits, -1)))
        .sum(-1)[keep]
        .sum()
    )
    (ce + distill_weight * kl).backward()
    assert out.ce_sum.item() == pytest.approx(ce.item(), rel=1e-5)
    assert out.num_correct.item() == int((logits.argmax(-1) == draft_labels)[keep].sum())
    if distill_weight:
        assert out.kl_sum.item() == pytest.approx(kl.item(), rel=1e-4)
    for key, param in drafter.named_parameters():
        torch.testing.assert_close(grads[key], param.grad, rtol=1e-4, atol=1e-6)


def test_build_model_chooses_the_draft_vocabulary_from_the_data(tmp_path):
    """drafter.draft_vocab_size=K: the K ids are the data's most frequent trained-on tokens plus the tokenizer's
    special tokens; the full size (or none) keeps the whole vocabulary; an init_from drafter's map wins and a
    conflicting size is one error."""
    from data_prep.stage1 import prepare_stage1
    from longspec.data.token_counts import token_counts
    from longspec.testing import build_byte_tokenizer, save_tiny_target
    from longspec.train.build import build_model

    tokenizer = build_byte_tokenizer()
    target = save_tiny_target("llama", tmp_path / "target")
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"text": "abcab cab " * (i + 3)}) + "\n" for i in range(40))
    )
    prepare_stage1(source=str(tmp_path / "rows.jsonl"), tokenizer=tokenizer, out=str(tmp_path / "d1"), seq_len=32,
                   progress=False)  # fmt: skip
    base = ["stage=tiny_stage1", "target=tiny_llama", f"target.path={target}", f"data.path={tmp_path / 'd1'}"]

    def built(*extra: str):
        cfg = load_config([*base, *extra])
        model = build_model(
            cfg, {}, dtype=torch.float32, device=torch.device("cpu"), rank=0, tokenizer=tokenizer
        )
        return model.drafter

    full = built()
    assert full.draft_vocab is None
    assert built(f"drafter.draft_vocab_size={full.config.vocab_size}").draft_vocab is None
    with pytest.raises(
        ValueError, match=f"larger than the target's vocabulary of {full.config.vocab_size} ids"
    ):
        built(f"drafter.draft_vocab_size={full.config.vocab_size + 1}")
    drafter = built("drafter.draft_vocab_size=12")
    ids = set(drafter.draft_vocab.ids.tolist())
    assert drafter.config.draft_vocab_size == 12 and set(tokenizer.all_special_ids) <= ids
    counts = token_counts([tmp_path / "d1"], drafter.config.vocab_size)
    frequent = [int(i) for i in counts.argsort()[::-1] if counts[i] > 0][
        : 12 - len(tokenizer.all_special_ids)
    ]
    assert set(frequent) <= ids
    drafter.save_pretrained(tmp_path / "saved")
    again = built(f"init_from={tmp_path / 'saved'}")
    assert torch.equal(again.draft_vocab.ids, drafter.draft_vocab.ids)
    with pytest.raises(
        ValueError, match="drafter.draft_vocab_size=20 but the init_from drafter drafts over 12 ids"
    ):
        built(f"init_from={tmp_path / 'saved'}", "drafter.draft_vocab_size=20")
    with pytest.raises(FileNotFoundError, match="drafter.draft_vocab_data"):
        load_config([*base, "drafter.draft_vocab_data=[/nonexistent]"])
