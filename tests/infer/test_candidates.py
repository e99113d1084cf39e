"""The round shapes (`longspec.infer.candidates`): what each one answers, its name (the key of stats, reports and
the round-cost tables on disk) and the user input that becomes one."""

import dataclasses

import pytest
import torch

from longspec.infer.candidates import (
    AUTO_LOOKUPS,
    AUTO_TREES,
    DEFAULT_TREE_WIDTHS,
    DrafterTree,
    Lookup,
    Plain,
    RoundShape,
    as_shape,
    parse,
)
from longspec.infer.config import GenerationConfig
from longspec.infer.tree import TreeLayout

SHAPES = (Plain(), DrafterTree((4, 16, 16)), DrafterTree((1, 1)), Lookup(8), Lookup(16, 4))


def test_each_shape_answers_what_a_round_needs_of_it():
    # (drafter, lookup, depth, nodes, max_children, model widths, name, static step key at max_ngram 3)
    expected = [
        (False, False, 0, 1, 0, (), "ar", ("tree", ())),
        (True, False, 3, 37, 16, (4, 16, 16), "4-16-16", ("tree", (4, 16, 16))),
        (True, False, 2, 3, 1, (1, 1), "1-1", ("tree", (1, 1))),
        (False, True, 8, 9, 1, (1,) * 8, "lookup8", ("lookup", 8, 1, 3)),
        (False, True, 16, 65, 4, (4,) + (1,) * 15, "lookup16x4", ("lookup", 16, 4, 3)),
    ]
    for shape, want in zip(SHAPES, expected, strict=True):
        got = (
            shape.drafts_with_drafter, shape.drafts_by_lookup, shape.depth, shape.nodes, shape.max_children,
            shape.model_widths, shape.name, shape.shape_key(3),
        )  # fmt: skip
        assert got == want, shape
        assert shape.speculates == (shape.depth > 0) and parse(shape.name) == shape
    assert Lookup(16, 4).shape_key(2) != Lookup(16, 4).shape_key(3)  # a lookup's step depends on its n-gram


def test_the_names_are_the_ones_results_and_cost_caches_hold():
    assert [c.name for c in AUTO_TREES + AUTO_LOOKUPS] == [
        "ar", "1", "1-1", "1-1-1-1", "2-2-2", "4-4-4", "4-8-8-8", "4-16-16-16", "4-16-16-16-16",
        "lookup2", "lookup4", "lookup8", "lookup16", "lookup16x2", "lookup16x4",
    ]  # fmt: skip
    assert AUTO_TREES[-1] == DrafterTree(DEFAULT_TREE_WIDTHS) and AUTO_TREES[0] == Plain()


def test_shapes_are_hashable_values_of_their_own_kind():
    assert len({*SHAPES, Plain(), DrafterTree([4, 16, 16]), Lookup(8, 1)}) == len(SHAPES)
    assert DrafterTree([4, 16, 16]).widths == (4, 16, 16)  # normalised: hashable
    assert DrafterTree((1,)) != Lookup(1) and Plain() != DrafterTree((1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        Lookup(8).length = 4
    with pytest.raises(TypeError):
        RoundShape()  # only its kinds are shapes
    with pytest.raises(TypeError, match="speculates"):
        bool(Plain())  # ask what is meant: a plain step is a shape as much as a tree is
    for bad in ((), (4, 0), (-1,)):
        with pytest.raises(ValueError, match="tree widths"):
            DrafterTree(bad)
    with pytest.raises(ValueError, match="lookup"):
        Lookup(0)


def test_containment_stays_within_a_family_and_a_plain_step_is_part_of_every_round():
    tree, chain = DrafterTree((4, 16, 16)), DrafterTree((1, 1))
    assert tree.contains(chain) and not chain.contains(tree) and tree.contains(tree)
    assert tree.contains(DrafterTree((4, 8))) and not tree.contains(DrafterTree((4, 16, 16, 1)))
    assert not tree.contains(DrafterTree((5,)))
    assert Lookup(16, 4).contains(Lookup(8, 2)) and not Lookup(8, 2).contains(Lookup(16))
    assert not Lookup(16, 4).contains(Lookup(8, 5))
    for shape in SHAPES:
        assert shape.contains(Plain())
        assert Plain().contains(shape) == (not shape.speculates)
    assert not tree.contains(Lookup(1)) and not Lookup(16, 4).contains(chain)  # different work


def test_the_sort_key_orders_the_drafters_shapes_by_widths_then_the_lookups():
    shuffled = [Lookup(16), DrafterTree((4, 4, 4)), Lookup(2, 2), Plain(), DrafterTree((1,)), Lookup(2)]
    assert sorted(shuffled, key=lambda c: c.sort_key) == [
        Plain(), DrafterTree((1,)), DrafterTree((4, 4, 4)), Lookup(2), Lookup(2, 2), Lookup(16)
    ]  # fmt: skip


def test_level_ranks_follow_each_shapes_layout():
    assert Plain().level_ranks([0]) == []
    tree = DrafterTree((2, 3, 2))  # levels at slots 1-2, 3-5, 6-7
    assert tree.level_ranks([0, 2, 5, 6]) == [1, 2, 0]
    assert tree.layout == TreeLayout((2, 3, 2))
    forest = Lookup(3, 2)  # level 1 at slots 1-2 (the branch), then one node per level below it
    assert forest.level_ranks([0, 2, 4]) == [1, 0] and forest.level_ranks([0]) == []


def test_user_input_becomes_a_shape():
    assert as_shape("lookup16x4") == Lookup(16, 4) and as_shape("ar") == Plain()
    assert as_shape([4, 16]) == as_shape(torch.tensor([4, 16])) == as_shape("4-16") == DrafterTree((4, 16))
    assert as_shape(()) == Plain() and as_shape(Lookup(2)) == Lookup(2)
    for bad in (4, [4.0], [True], b"4", torch.tensor([1.5])):
        with pytest.raises(TypeError, match="not a round shape"):
            as_shape(bad)
    for bad in ("lookup", "4-0", "big", [0]):
        with pytest.raises(ValueError):
            as_shape(bad)


def test_the_configs_tree_field_keeps_its_recorded_form():
    """GenerationConfig.tree holds level widths as a tuple and a lookup as itself, however given: what
    results.json's config and the eval's resume key record; `fixed_tree` is the shape."""
    for given, recorded, fixed in (
        ("4-16", (4, 16), DrafterTree((4, 16))),
        ([4, 16], (4, 16), DrafterTree((4, 16))),
        (DrafterTree((4, 16)), (4, 16), DrafterTree((4, 16))),
        ("lookup16x4", Lookup(16, 4), Lookup(16, 4)),
        ("auto", "auto", None),
    ):
        config = GenerationConfig(tree=given)
        assert config.tree == recorded and config.fixed_tree == fixed, given
    assert dataclasses.asdict(GenerationConfig(tree="lookup16x4"))["tree"] == {"length": 16, "branches": 4}
    for plain in ("ar", (), Plain()):
        with pytest.raises(ValueError, match="no speculation"):
            GenerationConfig(tree=plain)
    with pytest.raises(TypeError, match="tree"):
        GenerationConfig(tree=4)
