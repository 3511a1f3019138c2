"""Band names on the wire and their shapes in a payload."""

from __future__ import annotations

import pytest

from common.handoff.bands import Band, band_specs
from common.handoff.errors import HandoffError
from common.handoff.manifest import FieldSpec


def test_a_band_name_round_trips():
    band = Band("kv", 1, 2)
    assert band.name == "kv[1:2]"
    assert Band.parse("kv[1:2]") == band
    assert Band.parse("conv_state[0:64]") == Band("conv_state", 0, 64)


@pytest.mark.parametrize("name", ["kv", "kv[2:1]", "kv[1:1]", "top_k[0:1]", "kv[0:1]x", "kv[-1:2]"])
def test_what_is_not_a_band_name(name):
    assert Band.parse(name) is None


def test_a_bands_shape_narrows_its_split_dim():
    manifest = {"kv": FieldSpec("bfloat16", (2, 2, 3, 4, 2, 16)),
                "conv_state": FieldSpec("bfloat16", (3, 256, 3)),
                "ssm_state": FieldSpec("float32", (3, 4, 32, 32))}
    specs = band_specs(manifest, [Band("kv", 1, 2), Band("conv_state", 0, 64),
                                  Band("ssm_state", 2, 4)])
    assert specs["kv[1:2]"].shape == (2, 2, 3, 4, 1, 16)
    assert specs["conv_state[0:64]"].shape == (3, 64, 3)
    assert specs["ssm_state[2:4]"] == FieldSpec("float32", (3, 2, 32, 32))
    with pytest.raises(HandoffError) as err:
        Band("kv", 1, 3).spec(manifest["kv"])
    assert err.value.code == "INVALID_ARGUMENT"
