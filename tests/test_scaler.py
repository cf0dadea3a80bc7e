"""LossScaler: the update rule of a dynamic scale, fixed scales, options, and state round trips."""

import dataclasses

import pytest

from zero1_mpi import LossScaler

pytestmark = pytest.mark.mpi_independent  # (conftest.py)


def test_dynamic_scale_backs_off_and_grows():
    s = LossScaler.dynamic_scaler(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=3, min_scale=256.0)
    s = s.update(overflow=True)
    assert (s.scale, s.good_steps) == (512.0, 0)
    s = s.update(False).update(False)
    assert (s.scale, s.good_steps) == (512.0, 2)
    s = s.update(False)                      # the third good step in a row grows it
    assert (s.scale, s.good_steps) == (1024.0, 0)
    s = s.update(False).update(True)         # an overflow resets the count
    assert (s.scale, s.good_steps) == (512.0, 0)
    s = s.update(True).update(True)          # never below the minimum
    assert s.scale == 256.0 and s.at_minimum


def test_growth_stops_before_infinity():
    s = LossScaler.dynamic_scaler(init_scale=3e38, growth_interval=1)
    assert s.update(False).scale == 3e38


def test_fixed_and_no_scaling_never_change():
    for s in (LossScaler.from_option(None), LossScaler.from_option(128.0)):
        assert s.update(True) is s and s.update(False) is s and s.at_minimum
    assert LossScaler.from_option(None).scale == 1.0
    assert LossScaler.from_option(128).scale == 128.0
    dynamic = LossScaler.from_option("dynamic")
    assert dynamic.dynamic and dynamic.scale == 2.0 ** 16 and dynamic.growth_interval == 2000


@pytest.mark.parametrize("option, words", [
    ("auto", "loss_scale='auto'"), (True, "loss_scale=True"), (-1.0, "scale=-1.0"),
    (float("inf"), "scale=inf"),
])
def test_bad_options_name_the_value(option, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        LossScaler.from_option(option)


@pytest.mark.parametrize("field, value", [("growth_factor", 0.5), ("backoff_factor", 1.0),
                                          ("growth_interval", 0), ("min_scale", 0.0)])
def test_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        LossScaler.dynamic_scaler(**{field: value})


def test_state_round_trip_keeps_every_field():
    s = LossScaler.dynamic_scaler(init_scale=512.0, growth_factor=3.0, backoff_factor=0.25,
                                  growth_interval=7, min_scale=2.0).update(False).update(False)
    state = s.state()
    assert set(state) == {f.name for f in dataclasses.fields(LossScaler)}
    assert LossScaler.from_state(state) == s and s.good_steps == 2
