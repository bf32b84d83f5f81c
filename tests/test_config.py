"""Tests of the ``hecate`` config section: parse_hecate_section / split_hecate_section."""
from __future__ import annotations

import copy
import json
import math
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, Dict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_hecate.config import HecateConfig, parse_hecate_section, split_hecate_section
from ds_hecate.errors import HecateConfigError, HecateError

KNOWN_KEYS = ("enabled", "placement", "load_window", "load_predictor", "materialize_budget_mb", "overlap_degree", "calibration",
              "replan_tolerance", "plan_budget_us", "search_budget_us", "search_slice_us", "rematerialize", "fanout", "relay_chunks", "prefetch", "reshard_interval", "compute_s_per_pair", "replica_overhead_s", "link_gbps",
              "inter_node_gbps",
              "non_moe_time_s", "ranks_per_node", "ep_size", "reduce_dtype", "collective_timeout_s", "log_conversion", "monitor",
              "monitor_interval", "profile", "trace_file", "comm_backend", "device_kernels")
DEFAULTS = dict(enabled=False, placement="hecate", load_window=5, load_predictor="robust", fanout=4, relay_chunks=4,
                materialize_budget_mb=1024.0, overlap_degree=None,
                calibration=True, replan_tolerance=0.05, plan_budget_us=None, search_budget_us=200000.0, search_slice_us=None,
                rematerialize=None, prefetch=True, reshard_interval=100,
                compute_s_per_pair=None, replica_overhead_s=None, link_gbps=None, inter_node_gbps=None, non_moe_time_s=None,
                ranks_per_node=None, ep_size=None, reduce_dtype="auto", collective_timeout_s=600.0, log_conversion=True,
                monitor=True, monitor_interval=1, profile=False, trace_file=None, comm_backend="auto", device_kernels="auto")
PLACEMENTS = ["hecate", "cost", "owner", "local", "shadow", "all"]


def _fields(cfg: HecateConfig) -> dict:
    return {k: getattr(cfg, k) for k in KNOWN_KEYS}


# ---------------------------------------------------------------------------------------------------------------
# parse_hecate_section
# ---------------------------------------------------------------------------------------------------------------
def test_known_keys_match_schema():
    assert tuple(HecateConfig.model_fields) == KNOWN_KEYS


def test_defaults():
    cfg = parse_hecate_section({})
    assert isinstance(cfg, HecateConfig)
    assert _fields(cfg) == DEFAULTS
    assert _fields(HecateConfig()) == DEFAULTS


def test_full_valid_section():
    raw = dict(enabled=True, placement="local", load_window=3, load_predictor="mean", fanout=2, relay_chunks=3, materialize_budget_mb=12.5, overlap_degree=2,
               calibration=False, replan_tolerance=0.2, plan_budget_us=250.0, search_budget_us=0.0, search_slice_us=300.0, rematerialize=True, prefetch=False, reshard_interval=7,
               compute_s_per_pair=1e-6, replica_overhead_s=2e-4,
               link_gbps=100.0, inter_node_gbps=12.5, non_moe_time_s=0.01, ranks_per_node=8, ep_size=64,
               reduce_dtype="bf16",
               collective_timeout_s=30.5, log_conversion=False, monitor=False, monitor_interval=5, profile=True,
               trace_file="run/trace.jsonl", comm_backend="torch", device_kernels="cupy")
    assert _fields(parse_hecate_section(raw)) == raw


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_accepted(placement):
    assert parse_hecate_section({"placement": placement}).placement == placement


def test_placement_names_match_planner_policies():
    """The config accepts exactly the planner's policies (one list, planning.placement.PLACEMENT_POLICIES)."""
    from typing import get_args

    from ds_hecate.planning.placement import PLACEMENT_POLICIES, POLICIES
    assert get_args(HecateConfig.model_fields["placement"].annotation) == PLACEMENT_POLICIES
    assert set(PLACEMENT_POLICIES) == {"hecate", *POLICIES}
    for name in PLACEMENT_POLICIES:
        assert parse_hecate_section({"placement": name}).placement == name


@pytest.mark.parametrize("value", [1, 1.0, 86400, 86400.0, 1e-3])
def test_collective_timeout_accepts_bounds(value):
    assert parse_hecate_section({"collective_timeout_s": value}).collective_timeout_s == float(value)


def test_config_is_frozen():
    cfg = parse_hecate_section({"enabled": True})
    with pytest.raises(Exception):
        cfg.enabled = False  # type: ignore[misc]
    assert cfg.enabled is True


def test_accepts_any_mapping():
    assert parse_hecate_section(MappingProxyType({"enabled": True})).enabled is True
    assert parse_hecate_section(OrderedDict(placement="owner")).placement == "owner"


def test_unknown_key_is_named():
    with pytest.raises(HecateConfigError) as info:
        parse_hecate_section({"enabled": True, "plaecment": "cost"})
    msg = str(info.value)
    assert "plaecment" in msg
    assert "zero_optimization.hecate.plaecment" in msg
    assert "enabled" in msg  # the known keys are listed


def test_where_is_used_in_messages():
    with pytest.raises(HecateConfigError, match=r"'hecate\.enabled'"):
        parse_hecate_section({"enabled": "yes"}, where="hecate")


@pytest.mark.parametrize("key,value", [
    ("enabled", "yes"),
    ("enabled", 1),
    ("enabled", None),
    ("enabled", "true"),
    ("placement", 3),
    ("placement", "greedy"),
    ("placement", "Cost"),
    ("placement", None),
    ("replan_tolerance", -0.01),
    ("replan_tolerance", 1.5),
    ("replan_tolerance", "5%"),
    ("replan_tolerance", float("nan")),
    ("plan_budget_us", -1.0),
    ("plan_budget_us", "fast"),
    ("search_budget_us", -5),
    ("search_budget_us", None),
    ("search_slice_us", -1),
    ("ranks_per_node", 0),
    ("ranks_per_node", -4),
    ("ranks_per_node", 2.0),
    ("ranks_per_node", "8"),
    ("ranks_per_node", True),
    ("ep_size", 0),
    ("ep_size", -8),
    ("ep_size", 8.0),
    ("ep_size", "8"),
    ("ep_size", True),
    ("ep_size", 1 << 31),
    ("collective_timeout_s", -1),
    ("collective_timeout_s", 0),
    ("collective_timeout_s", 0.0),
    ("collective_timeout_s", 86400.5),
    ("collective_timeout_s", "60"),
    ("collective_timeout_s", float("nan")),
    ("collective_timeout_s", float("inf")),
    ("collective_timeout_s", None),
    ("reduce_dtype", "fp8"),
    ("reduce_dtype", "fp16"),
    ("reduce_dtype", None),
    ("rematerialize", "yes"),
    ("rematerialize", 1),
    ("log_conversion", "no"),
    ("log_conversion", 0),
])
def test_wrong_type_or_value_is_named(key, value):
    with pytest.raises(HecateConfigError) as info:
        parse_hecate_section({key: value})
    assert f"zero_optimization.hecate.{key}" in str(info.value)


def test_several_problems_all_reported():
    with pytest.raises(HecateConfigError) as info:
        parse_hecate_section({"enabled": "yes", "placement": 3, "bogus": 1})
    msg = str(info.value)
    for key in ("enabled", "placement", "bogus"):
        assert key in msg


def test_error_hierarchy():
    with pytest.raises(HecateConfigError) as info:
        parse_hecate_section({"enabled": "yes"})
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, HecateError)


@pytest.mark.parametrize("raw", ["yes", True, False, 1, 0, [], [["enabled", True]], None, 3.5, b"{}"])
def test_section_not_a_dict(raw):
    with pytest.raises(HecateConfigError, match="expected a JSON object"):
        parse_hecate_section(raw)


def test_non_string_keys():
    with pytest.raises(HecateConfigError):
        parse_hecate_section({1: True})
    with pytest.raises(HecateConfigError):
        parse_hecate_section({("enabled",): True})


def test_parse_does_not_mutate_input():
    raw = {"enabled": True, "placement": "owner", "ranks_per_node": 4}
    before = copy.deepcopy(raw)
    parse_hecate_section(raw)
    assert raw == before
    bad: Dict[str, Any] = {"enabled": "yes", "junk": [1, {"a": 2}]}
    before = copy.deepcopy(bad)
    with pytest.raises(HecateConfigError):
        parse_hecate_section(bad)
    assert bad == before


# ---------------------------------------------------------------------------------------------------------------
# split_hecate_section
# ---------------------------------------------------------------------------------------------------------------
def _ds_config(**extra):
    cfg = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": True}}
    cfg.update(extra)
    return cfg


def test_split_without_section():
    cfg = _ds_config()
    before = copy.deepcopy(cfg)
    hcfg, stripped = split_hecate_section(cfg)
    assert hcfg is None
    assert stripped == before
    assert stripped is not cfg
    assert cfg == before


def test_split_nested_section():
    cfg = _ds_config()
    cfg["zero_optimization"]["hecate"] = {"enabled": True, "placement": "local"}
    before = copy.deepcopy(cfg)
    hcfg, stripped = split_hecate_section(cfg)
    assert isinstance(hcfg, HecateConfig)
    assert hcfg.enabled is True and hcfg.placement == "local"
    assert "hecate" not in stripped["zero_optimization"]
    assert "hecate" not in stripped
    expected = copy.deepcopy(before)
    del expected["zero_optimization"]["hecate"]
    assert stripped == expected
    assert cfg == before, "input must not be mutated"
    assert "hecate" in cfg["zero_optimization"]
    # the stripped config shares nothing mutable with the input
    stripped["optimizer"]["params"]["lr"] = 5.0
    stripped["zero_optimization"]["stage"] = 3
    assert cfg == before


def test_split_top_level_section():
    cfg = _ds_config(hecate={"enabled": True, "reduce_dtype": "bf16"})
    before = copy.deepcopy(cfg)
    hcfg, stripped = split_hecate_section(cfg)
    assert hcfg is not None
    assert hcfg.enabled is True and hcfg.reduce_dtype == "bf16"
    expected = copy.deepcopy(before)
    del expected["hecate"]
    assert stripped == expected
    assert cfg == before


def test_split_empty_section_gives_defaults():
    hcfg, stripped = split_hecate_section(_ds_config(hecate={}))
    assert hcfg is not None
    assert _fields(hcfg) == DEFAULTS
    assert "hecate" not in stripped
    cfg = _ds_config()
    cfg["zero_optimization"]["hecate"] = {}
    hcfg, stripped = split_hecate_section(cfg)
    assert hcfg is not None
    assert _fields(hcfg) == DEFAULTS
    assert stripped["zero_optimization"] == {"stage": 2, "overlap_comm": True}


def test_split_both_present_is_error():
    cfg = _ds_config(hecate={"enabled": True})
    cfg["zero_optimization"]["hecate"] = {"enabled": True}
    before = copy.deepcopy(cfg)
    with pytest.raises(HecateConfigError, match="both"):
        split_hecate_section(cfg)
    assert cfg == before


def test_split_both_present_even_if_identical_and_empty():
    cfg = _ds_config(hecate={})
    cfg["zero_optimization"]["hecate"] = {}
    with pytest.raises(HecateConfigError):
        split_hecate_section(cfg)


def test_split_errors_name_where_the_section_was():
    with pytest.raises(HecateConfigError, match=r"'hecate\.placement'"):
        split_hecate_section(_ds_config(hecate={"placement": 3}))
    cfg = _ds_config()
    cfg["zero_optimization"]["hecate"] = {"placement": 3}
    with pytest.raises(HecateConfigError, match=r"'zero_optimization\.hecate\.placement'"):
        split_hecate_section(cfg)
    cfg["zero_optimization"]["hecate"] = {"frobnicate": 1}
    with pytest.raises(HecateConfigError, match=r"zero_optimization\.hecate\.frobnicate"):
        split_hecate_section(cfg)


@pytest.mark.parametrize("section", ["yes", True, 1, [], [1, 2]])
def test_split_section_not_a_dict(section):
    with pytest.raises(HecateConfigError):
        split_hecate_section(_ds_config(hecate=section))
    cfg = _ds_config()
    cfg["zero_optimization"]["hecate"] = section
    with pytest.raises(HecateConfigError):
        split_hecate_section(cfg)


def test_split_zero_optimization_not_a_dict():
    # a non-mapping zero_optimization is DeepSpeed's business, not ours: no nested section, config passed on
    cfg = _ds_config(zero_optimization=2)
    hcfg, stripped = split_hecate_section(cfg)
    assert hcfg is None and stripped == cfg
    hcfg, stripped = split_hecate_section(_ds_config(zero_optimization=None, hecate={"enabled": True}))
    assert hcfg is not None
    assert hcfg.enabled is True and stripped["zero_optimization"] is None and "hecate" not in stripped


def test_split_from_json_file_contents():
    text = json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2, "hecate": {
        "enabled": True, "placement": "cost", "ranks_per_node": 8, "collective_timeout_s": 120}}})
    hcfg, stripped = split_hecate_section(json.loads(text))
    assert hcfg is not None
    assert hcfg.enabled and hcfg.ranks_per_node == 8 and hcfg.collective_timeout_s == 120.0
    assert stripped == {"train_batch_size": 4, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("nested_null", [True, False])
def test_split_strips_null_section(nested_null):
    """'hecate': null means an empty section (all defaults: disabled) and is stripped like any other."""
    cfg = _ds_config()
    if nested_null:
        cfg["zero_optimization"]["hecate"] = None
    else:
        cfg["hecate"] = None
    hcfg, stripped = split_hecate_section(cfg)
    assert hcfg == HecateConfig() and not hcfg.enabled
    assert "hecate" not in stripped
    assert "hecate" not in stripped["zero_optimization"]


# ---------------------------------------------------------------------------------------------------------------
# Fuzz: parsing either returns a HecateConfig or raises HecateConfigError, nothing else
# ---------------------------------------------------------------------------------------------------------------
# Python's int->str conversion limit is 4300 digits; see the xfail test below for ints beyond it.
_big_ints = st.integers(min_value=-(10 ** 4000), max_value=10 ** 4000)
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 100000), _big_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                                     -0.0, 5e-324, 1.7e308]),
    st.text(max_size=20), st.sampled_from(["cost", "owner", "local", "fp32", "bf16", "fp8", "true", "1", ""]),
    st.binary(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.tuples(children, children),
                               st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
_keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12), st.integers(-5, 5), st.none(),
                  st.tuples(st.integers(0, 3)), st.sampled_from(["self", "__class__", "model_config", "__dict__",
                                                                 "Enabled", " enabled", "enabled "]))
_VALID = {
    "enabled": st.booleans(), "log_conversion": st.booleans(),
    "placement": st.sampled_from(PLACEMENTS), "reduce_dtype": st.sampled_from(["auto", "fp32", "bf16"]),
    "load_window": st.integers(1, 10000), "load_predictor": st.sampled_from(["robust", "mean"]),
    "fanout": st.integers(0, 1 << 20), "relay_chunks": st.integers(1, 1024), "materialize_budget_mb": st.floats(0, 1e9),
    "overlap_degree": st.one_of(st.none(), st.integers(0, 1 << 20)), "calibration": st.booleans(),
    "replan_tolerance": st.floats(0.0, 1.0), "plan_budget_us": st.none() | st.floats(0.0, 1e9),
    "search_budget_us": st.floats(0.0, 1e9), "search_slice_us": st.none() | st.floats(0.0, 1e9), "rematerialize": st.none() | st.booleans(), "prefetch": st.booleans(), "reshard_interval": st.integers(0, 1 << 30),
    "compute_s_per_pair": st.one_of(st.none(), st.floats(1e-12, 1.0)),
    "replica_overhead_s": st.one_of(st.none(), st.floats(0.0, 1.0)),
    "link_gbps": st.one_of(st.none(), st.floats(1e-3, 1e6)),
    "inter_node_gbps": st.one_of(st.none(), st.floats(1e-3, 1e6)),
    "non_moe_time_s": st.one_of(st.none(), st.floats(0, 3600.0)),
    "ranks_per_node": st.one_of(st.none(), st.integers(1, 10 ** 30)),
    "ep_size": st.one_of(st.none(), st.integers(1, 1 << 30)),
    "collective_timeout_s": st.one_of(st.integers(1, 86400), st.floats(min_value=1e-9, max_value=86400.0)),
    "monitor": st.booleans(), "monitor_interval": st.integers(1, 1 << 30), "profile": st.booleans(),
    "trace_file": st.one_of(st.none(), st.text(min_size=1, max_size=40)),
    "comm_backend": st.sampled_from(["auto", "torch", "cupy"]),
    "device_kernels": st.sampled_from(["auto", "torch", "cupy"]),
}


@st.composite
def _mostly_valid_sections(draw):
    """Sections of known keys, each value valid with high probability, so the fuzz also reaches the success
    path and the single-bad-value paths."""
    keys = draw(st.lists(st.sampled_from(KNOWN_KEYS), unique=True, max_size=8))
    out = {}
    for k in keys:
        out[k] = draw(_values) if draw(st.integers(0, 9)) == 0 else draw(_VALID[k])
    if draw(st.integers(0, 7)) == 0:
        out[draw(st.text(min_size=1, max_size=8))] = draw(_values)
    return out


_sections = st.one_of(_mostly_valid_sections(), st.dictionaries(_keys, _values, max_size=7),
                      st.dictionaries(st.sampled_from(KNOWN_KEYS), _values, max_size=6),
                      _values)


def _check_parsed(cfg):
    assert isinstance(cfg, HecateConfig)
    assert isinstance(cfg.enabled, bool) and isinstance(cfg.log_conversion, bool)
    assert cfg.placement in PLACEMENTS
    assert type(cfg.load_window) is int and cfg.load_window >= 1
    assert isinstance(cfg.materialize_budget_mb, float) and cfg.materialize_budget_mb >= 0
    assert type(cfg.reshard_interval) is int and cfg.reshard_interval >= 0
    assert cfg.reduce_dtype in ("auto", "fp32", "bf16")
    assert cfg.ranks_per_node is None or (type(cfg.ranks_per_node) is int and cfg.ranks_per_node >= 1)
    assert cfg.ep_size is None or (type(cfg.ep_size) is int and 1 <= cfg.ep_size <= 1 << 30)
    assert isinstance(cfg.collective_timeout_s, float) and 0 < cfg.collective_timeout_s <= 86400.0


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(section=_sections, where=st.sampled_from(["zero_optimization.hecate", "hecate"]))
def test_fuzz_parse_only_raises_config_error(section, where):
    before = repr(section)
    try:
        cfg = parse_hecate_section(section, where)
    except HecateConfigError as exc:
        assert type(exc) is HecateConfigError
        assert str(exc)
    else:
        _check_parsed(cfg)
        assert isinstance(section, dict) and set(section) <= set(KNOWN_KEYS)
    assert repr(section) == before, "input must not be mutated"


_top_values = st.one_of(st.none(), _sections)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(nested=st.one_of(st.just("absent"), _top_values), top=st.one_of(st.just("absent"), _top_values),
       zero_extra=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "hecate"), _values, max_size=3),
       other=st.dictionaries(st.text(max_size=6).filter(lambda k: k not in ("hecate", "zero_optimization")),
                             _values, max_size=3))
def test_fuzz_split_only_raises_config_error(nested, top, zero_extra, other):
    cfg = dict(other)
    cfg["zero_optimization"] = dict(zero_extra)
    if nested != "absent":
        cfg["zero_optimization"]["hecate"] = nested
    if top != "absent":
        cfg["hecate"] = top
    before = repr(cfg)
    present = lambda v: v != "absent"  # noqa: E731  (a null section is present: it means {})
    try:
        hcfg, stripped = split_hecate_section(cfg)
    except HecateConfigError:
        pass
    else:
        assert not (present(nested) and present(top)), "both sections present must be an error"
        assert repr(cfg) == before
        if hcfg is None:
            assert not present(nested) and not present(top)
            assert repr(stripped) == before
        else:
            _check_parsed(hcfg)
            assert present(nested) or present(top)
            # the section is gone, everything else kept (a null 'hecate' entry is not looked at here)
            if present(top):
                assert "hecate" not in stripped
            if present(nested):
                assert "hecate" not in stripped["zero_optimization"]
            drop = lambda d: {k: v for k, v in d.items() if k != "hecate"}  # noqa: E731
            assert repr(drop({k: v for k, v in stripped.items() if k != "zero_optimization"})) == \
                repr(drop({k: v for k, v in cfg.items() if k != "zero_optimization"}))
            assert repr(drop(stripped["zero_optimization"])) == repr(drop(cfg["zero_optimization"]))
    assert repr(cfg) == before, "input must not be mutated"


@pytest.mark.parametrize("section", [{"enabled": 10 ** 5000}, {"placement": [1, -(10 ** 4400)]},
                                     {"reduce_dtype": {"x": 10 ** 5000}}])
def test_huge_int_in_bad_value_raises_config_error(section):
    with pytest.raises(HecateConfigError):
        parse_hecate_section(section)


def test_deeply_nested_bad_value_raises_config_error():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(HecateConfigError):
        parse_hecate_section({"placement": deep})


def test_huge_valid_int_is_accepted():
    # no upper bound on ranks_per_node in the schema; a huge valid value must not crash parsing
    cfg = parse_hecate_section({"ranks_per_node": 10 ** 5000})
    assert cfg.ranks_per_node == 10 ** 5000
    assert math.isfinite(cfg.collective_timeout_s)


def test_rematerialize_null_resolves_by_slots_per_owned_expert():
    """null: re-materialize where the even resident share is under a quarter of a rank's experts and one layer at
    a time buys more; explicit values win (the pool's per-layer decision, ds_hecate.planning.replica_pool)."""
    from ds_hecate.planning.replica_pool import ReplicaPool

    mib = 1 << 20

    def resolved(setting, budget_mb, expert_bytes, owned):
        pool = ReplicaPool.plan(budget_mb, expert_bytes, owned, setting)
        assert len({g.rematerialize for g in pool.grants}) == 1   # identical layers decide alike
        return pool.rematerializes

    # 58 layers of 84 MiB experts and 8 GiB: 1 resident slot per layer in an even split
    assert resolved(None, 8192, [84 * mib] * 58, [32] * 58) is True    # 1 slot for 32 experts
    assert resolved(None, 8192, [84 * mib] * 58, [4] * 58) is False    # 1 slot for 4
    assert resolved(None, 8192, [84 * mib] * 58, [1] * 58) is False
    # no resident slot at all (Mixtral-like): re-materializing is the only way the budget helps
    assert resolved(None, 8192, [336 * mib] * 32, [1] * 32) is True
    # a budget too small even for one layer: nothing to gain
    assert resolved(None, 10, [84 * mib] * 58, [32] * 58) is False
    assert resolved(False, 8192, [84 * mib] * 58, [32] * 58) is False
    assert resolved(True, 1e9, [mib], [1]) is True


def test_deepspeeds_own_config_parse_validates_the_section_early():
    """Wherever DeepSpeed parses a config holding the section (``deepspeed.zero.Init`` under a Hugging Face ZeRO-3
    ``from_pretrained``, a ``DeepSpeedConfig`` built by hand) it is checked there, before any model is built: a near
    miss names the key meant; a valid section passes through."""
    import pydantic
    import ds_hecate  # noqa: F401  (patches DeepSpeed's ZeRO config)
    from deepspeed.runtime.config import DeepSpeedConfig

    ok = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, "hecate": {"enabled": True}}})
    assert ok.zero_config.hecate == {"enabled": True}
    with pytest.raises(pydantic.ValidationError, match=r"materialise_budget_mb'.*did you mean 'materialize_budget_mb'"):
        DeepSpeedConfig({"train_batch_size": 1,
                         "zero_optimization": {"stage": 3, "hecate": {"enabled": True, "materialise_budget_mb": 8}}})
