"""Issue 35 item 4: a quantised model's dtype is named as its user knows it ("8-bit (group 64)
...") wherever it is printed or returned (engine.info(), `benchmark`'s header, `tune`), never
as the packed weights' uint32. The bundled model is quantised by mlx-lm's own converter."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.base.bundled import REFERENCE_MODEL_DIR
from engine.model.config import dtype_name


@pytest.fixture(scope="module")
def q8_dir(tmp_path_factory):
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("q8") / "bundled-8bit"
    convert(str(REFERENCE_MODEL_DIR), str(out), quantize=True, q_bits=8, q_group_size=64)
    return out


def test_the_name_comes_from_the_quantization_block():
    q = {"quantization": {"bits": 4, "group_size": 32, "mode": "affine"}}
    assert dtype_name(q, "bfloat16") == "4-bit (group 32), bfloat16"
    assert dtype_name({"dequantized_from": q["quantization"]}, "float32") == "float32, dequantized from 4-bit (group 32)"
    assert dtype_name({"quantization": {"bits": 4, "mode": "mxfp4"}}, "bfloat16") == "mxfp4 4-bit, bfloat16"
    assert dtype_name({}, "float32") == "float32"


@pytest.mark.parametrize("dequantize", ["0", "1"])
def test_engine_info_names_the_quantisation(q8_dir, monkeypatch, dequantize):
    from engine import Engine

    monkeypatch.setenv("MLX_DSPARK_DEQUANTIZE", dequantize)
    with Engine(str(q8_dir), prefix_cache=False) as engine:
        name = engine.info()["dtype"]
    assert "8-bit (group 64)" in name and "uint32" not in name, name
    assert ("dequantized" in name) == (dequantize == "1"), name


def test_benchmark_header_says_8_bit(q8_dir, capsys, cache_home):
    from agent_bridge.cli import main

    assert main(["benchmark", "--model", str(q8_dir), "--contents", "edit", "--trials", "1",
                 "--max-tokens", "8", "--no-tune", "--max-draft", "8"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"model {q8_dir} (") and "8-bit (group 64)" in header and "uint32" not in header, header


def test_a_checkpoints_own_dtype_is_a_float_one(q8_dir):
    # where no compute dtype is set (a GPU), the name is the checkpoint's: that of its scales,
    # not the packed weights that come first in the parameter tree
    from mlx_lm.utils import load

    from engine.model.target import _weights_dtype

    model, _ = load(str(q8_dir))
    assert mx.issubdtype(_weights_dtype(model), mx.floating)
