"""Finding every model on the machine (engine/catalog/model_catalog.py, `mlx-dspark models`,
`GET /v1/models?all=1`) against fake hub-cache, LM Studio and user folder trees that hold
real files of tiny random models: a qwen3 in the hub cache, a llama in LM Studio with a
DFlash head beside it (and a head for another model that must not be listed), a 4-bit
model, a sliding-window gemma3 (checkpoint rollback) and a truncated download."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from engine.drafting.heads.export import dflash_config, random_head_checkpoint
from engine.catalog.model_catalog import find_models, pairing_problems, weights_missing
from test_models_cmd import make_hub_cache


def build_from_config(out: Path, config: dict, tokenizer_from: Path, quantize_bits: int | None = None) -> Path:
    """A model folder of this config with random weights (optionally quantised as mlx-lm does)."""
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config = {**config, "quantization": {"group_size": 32, "bits": quantize_bits}}
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


@pytest.fixture(scope="module")
def machine(tmp_path_factory, tiny_model_dir, tiny_llama_dir):
    """A home folder with a hub cache, LM Studio models, a user models folder and a config file."""
    root = tmp_path_factory.mktemp("machine")
    home, hub = root / "home", root / "hub"
    make_hub_cache(hub, "mlx-community/Qwen3-4B-4bit", tiny_model_dir)
    studio = home / ".lmstudio" / "models" / "tinyorg"
    shutil.copytree(tiny_llama_dir, studio / "tiny-llama")
    llama_cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    random_head_checkpoint(studio / "tiny-llama-DFlash", dflash_config(llama_cfg, mask_token_id=0, target_layer_ids=[0, 1]))
    other = dict(llama_cfg, hidden_size=96, num_hidden_layers=4)
    random_head_checkpoint(studio / "other-DFlash", dflash_config(other, mask_token_id=0, target_layer_ids=[0, 3]))
    mine = root / "mine"
    qcfg = json.loads((tiny_model_dir / "config.json").read_text())
    build_from_config(mine / "tiny-q4", qcfg, tiny_model_dir, quantize_bits=4)
    gemma = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": qcfg["vocab_size"],
             "sliding_window": 32, "sliding_window_pattern": 2, "max_position_embeddings": 8192}
    build_from_config(mine / "tiny-gemma3", gemma, tiny_model_dir)
    broken = shutil.copytree(tiny_model_dir, mine / "half-downloaded")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    extra = root / "extra"
    shutil.copytree(tiny_model_dir, extra / "from-config-file")
    config = root / "config"
    (config / "mlx-dspark").mkdir(parents=True)
    (config / "mlx-dspark" / "config.toml").write_text(f'models_dirs = ["{extra}"]\n')
    env = {"HOME": str(home), "HF_HUB_CACHE": str(hub), "XDG_CONFIG_HOME": str(config)}
    return {"env": env, "mine": mine, "studio": studio, "root": root}


@pytest.fixture
def env(machine, monkeypatch):
    for k, v in machine["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLX_DSPARK_CONFIG_DIR", raising=False)
    return machine


def _by_name(models) -> dict:
    return {m.name: m for m in models}


def test_every_source_is_found_and_described(env, tiny_model_dir):
    models = find_models([env["mine"]])
    found = _by_name(models)
    assert models[0].source == "bundled" and set(models[0].drafters) == {"dflash", "dspark"}
    assert set(found) - {"dspark-ref-hybrid"} == {"reference", "mlx-community/Qwen3-4B-4bit", "tinyorg/tiny-llama", "tiny-q4", "tiny-gemma3",
                          "half-downloaded", "from-config-file"}
    hub = found["mlx-community/Qwen3-4B-4bit"]
    assert hub.source == "hf-cache" and hub.model_type == "qwen3" and hub.context_length == 4096
    assert hub.cache_rollback == "trimmable" and hub.loads
    assert set(hub.drafters) == {"dflash", "dspark"}  # registered heads for Qwen3-4B
    assert hub.drafters_to_download == ["dflash", "dspark"]  # not in this hub cache
    assert hub.tool_call_format == "json_tools" and hub.reasoning_format == "<think>...</think>"
    size = sum(f.stat().st_size for f in tiny_model_dir.iterdir())
    assert hub.size_bytes == size  # the blobs behind the snapshot's symlinks
    n_params = sum(v.size for v in mx.load(str(tiny_model_dir / "model.safetensors")).values())
    assert hub.parameters == n_params
    llama = found["tinyorg/tiny-llama"]
    assert llama.source == "lmstudio" and llama.model_type == "llama"
    assert llama.drafters == {"dflash": str(env["studio"] / "tiny-llama-DFlash")}  # the other head doesn't fit
    assert llama.drafters_to_download == []
    q4 = found["tiny-q4"]
    assert q4.quantization == "4-bit (group 32)" and q4.parameters == n_params  # packed weights counted unpacked
    assert q4.size_bytes < size
    gemma = found["tiny-gemma3"]
    assert gemma.cache_rollback == "checkpoints" and gemma.context_length == 8192
    half = found["half-downloaded"]
    assert not half.loads and "model.safetensors" in half.problem and half.parameters is None
    assert found["from-config-file"].source == str(env["root"] / "extra")


def test_weights_missing_names_the_files(tmp_path, tiny_model_dir):
    d = shutil.copytree(tiny_model_dir, tmp_path / "m")
    assert weights_missing(d) == []
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                               "b": "model.safetensors"}}))
    assert weights_missing(d) == ["model-00001-of-00002.safetensors"]


def test_pairing_problems_name_each_mismatch(tiny_llama_dir):
    target = json.loads((tiny_llama_dir / "config.json").read_text())
    assert pairing_problems(dflash_config(target, mask_token_id=0, target_layer_ids=[0, 1]), target) == []
    wrong = dflash_config(dict(target, hidden_size=96, vocab_size=1000, num_hidden_layers=4), mask_token_id=0,
                          target_layer_ids=[0, 3])
    problems = pairing_problems(wrong, target)
    assert [p.split(":")[0] for p in problems] == ["hidden size", "vocabulary", "layer taps"]
    assert "96" in problems[0] and "1000" in problems[1] and "4-layer" in problems[2]


def test_models_command_table_and_json(env):
    run_env = {**os.environ, **env["env"]}
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "models", "--models-dir", str(env["mine"]), "--json"],
                       capture_output=True, text=True, env=run_env, timeout=180)
    assert r.returncode == 0, r.stderr
    models = {m["name"]: m for m in json.loads(r.stdout)}
    assert models["tiny-gemma3"]["cache_rollback"] == "checkpoints" and models["tiny-q4"]["quantization"]
    r = subprocess.run([sys.executable, "-m", "agent_bridge", "models", "--models-dir", str(env["mine"])],
                       capture_output=True, text=True, env=run_env, timeout=180)
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    assert header == ["model", "source", "arch", "params", "quant", "size", "context", "rollback", "drafters",
                      "tools", "reasoning", "images"]
    assert "tinyorg/tiny-llama" in r.stdout and "(!) half-downloaded: weights incomplete" in r.stdout
    assert "dflash*, dspark*" in r.stdout  # the hub model's registered heads, not downloaded


def test_v1_models_all_over_the_openai_sdk(env, tiny_engine):
    import openai

    from agent_bridge.app import create_app
    from server_harness import RunningServer

    with RunningServer(create_app(tiny_engine, models_dirs=[str(env["mine"])])) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        served = list(client.models.list())
        assert len(served) == 1 and served[0].model_extra["loaded"] is True
        everything = list(client.models.list(extra_query={"all": "1"}))
    ids = [m.id for m in everything]
    assert ids[0] == served[0].id and {"reference", "tiny-gemma3", "tinyorg/tiny-llama"} <= set(ids)
    gemma = [m for m in everything if m.id == "tiny-gemma3"][0]
    assert gemma.model_extra["loaded"] is False and gemma.model_extra["mlx_dspark"]["cache_rollback"] == "checkpoints"
