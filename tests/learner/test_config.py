"""LearnerConfig: names are validated, unknown fields raise, every field is documented."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from agentlog.learner.config import LearnerConfig


@pytest.mark.parametrize("field, value", [
    ("estimator", "ppo"), ("kl_type", "k4"), ("loss_agg", "sum"), ("optimizer", "sgd"),
    ("eps_clip", 1.5), ("dual_clip", 1.0), ("tis_cap", 0.0), ("grad_clip", -1.0),
    ("num_steps_per_rollout", 0), ("max_tokens_per_batch", 0),
    ("distill_coef", -0.5), ("distill_coef", float("nan")), ("distill_coef", float("inf")), ("distill_coef", "0.5"),
    ("distill_topk_coef", -1.0), ("distill_topk_coef", float("inf")),
    # Accepted before, each a NaN loss or NaN weights a step later:
    ("lr", float("inf")), ("adam_eps", 0.0), ("adam_eps", float("nan")), ("adv_eps", float("nan")), ("adv_eps", -1.0),
    ("kl_coef", float("nan")), ("kl_coef", float("inf")), ("kl_coef", -1.0), ("weight_decay", float("inf")),
    ("weight_decay", -1.0), ("entropy_coef", float("nan")), ("betas", (1.5, 0.9)), ("betas", (0.9,)),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"LearnerConfig.{field}.*{value!r}"):
        LearnerConfig(**{field: value})


def test_unknown_field_raises_listing_it():
    with pytest.raises(ValueError, match="unknown field.*'clip_eps'"):
        LearnerConfig.from_dict({"clip_eps": 0.2})


@pytest.mark.parametrize("field, replacement", [("temperature", "Sample.temperature"),
                                                ("updates_per_step", "num_steps_per_rollout")])
def test_removed_fields_raise_naming_what_replaced_them(field, replacement):
    with pytest.raises(ValueError, match=f"LearnerConfig.{field} was removed.*{replacement}"):
        LearnerConfig.from_dict({field: 2})


def test_round_trip_through_a_plain_dict():
    cfg = LearnerConfig(estimator="gspo", dual_clip=3.0, betas=[0.8, 0.9])
    assert cfg.betas == (0.8, 0.9)
    assert LearnerConfig.from_dict(cfg.to_dict()) == cfg


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(LearnerConfig))
    body = tree.body[0].body
    documented = set()
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            documented.add(node.target.id)
    assert documented == {f.name for f in dataclasses.fields(LearnerConfig)}
