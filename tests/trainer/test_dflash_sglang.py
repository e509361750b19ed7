"""An eaglet DFlash drafter loaded by SGLang 0.5.17's own classes (config, weight loading, the
context the DFlash worker writes into the draft KV cache), compared with eaglet's own computation of it. Cases:
dflash_sglang_cases.py, run with the SGLang venv's Python; 0.5.17 (the GPU's) from its own dir."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.services.trainer.checkpoint import save_dflash
from eaglet.services.trainer.dflash import DFlashConfig, DFlashDrafter

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
CASES = Path(__file__).with_name("dflash_sglang_cases.py")
# 0.5.17: the version the GPU image serves (0.5.23's parallel layers need a published parallel config besides)
PATHS = {"0.5.17": [ROOT / ".venv-sglang" / "sglang-0.5.17"]}


@pytest.mark.parametrize("version", list(PATHS))
def test_sglang_loads_the_drafter_and_computes_its_context_as_eaglet_does(tmp_path, version):
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY.relative_to(ROOT)} is missing: run `make install` (scripts/install-sglang-cpu.sh)")
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300, num_target_layers=6, target_layer_ids=[1, 3, 4],
                       block_size=4, mask_token_id=299, rope_theta=50000.0)  # fmt: skip
    drafter = DFlashDrafter(cfg, torch.randn(300, 64))
    with torch.no_grad():  # norms away from 1, so a norm SGLang skipped or doubled shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    save_dflash(tmp_path / "drafter", drafter, {"num_hidden_layers": 6, "eos_token_id": 2}, torch.float32)
    aux, positions = torch.randn(9, 3 * 64), torch.arange(3, 12)
    save_file({"aux": aux, "positions": positions}, str(tmp_path / "inputs.safetensors"))
    proc = subprocess.run(
        [str(SGLANG_PY), str(CASES), str(tmp_path / "drafter"), str(tmp_path / "inputs.safetensors"), str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*PATHS[version], ROOT]))},
    )  # fmt: skip
    assert proc.returncode == 0, f"cases failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    resolved = json.loads((tmp_path / "resolved.json").read_text())
    assert resolved["version"] == version
    assert resolved["target_layer_ids"] == [1, 3, 4] and resolved["num_context_features"] == 3
    assert resolved["block_size"] == 4 and resolved["mask_token_id"] == 299
    assert resolved["attention_type"] == "ENCODER_ONLY"  # the block is non-causal, as trained
    assert resolved["rope_base"] == 50000.0 and resolved["is_neox_style"]
    theirs = load_file(str(tmp_path / "sglang.safetensors"))
    with torch.no_grad():
        ctx = drafter.hidden_norm(drafter.fc(aux))
        ours = drafter.context_kv(aux[None], positions[None])
    torch.testing.assert_close(theirs["ctx"], ctx, rtol=1e-4, atol=1e-5)
    for i, (k, v) in enumerate(ours):  # ours [1, kv, S, d]; SGLang's [S, kv * d]
        torch.testing.assert_close(theirs[f"k{i}"], k[0].transpose(0, 1).reshape(9, -1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(theirs[f"v{i}"], v[0].transpose(0, 1).reshape(9, -1), rtol=1e-4, atol=1e-5)
