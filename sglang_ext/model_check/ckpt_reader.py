"""Reading the cast checkpoint on its own (no SGLang): config, index, tensors by name.

The check compares what SGLang loaded against these bytes, so they are read with plain
safetensors, one tensor at a time (a truncated check of the real 1.6 TB checkpoint touches
only the tensors it compares).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# SGLang 0.5.23 KimiK3ForConditionalGeneration.hf_to_sglang_mapper, as the issue states it:
# prefix "language_model.layers." -> "language_model.model.layers.", substring
# "block_sparse_moe" -> "mlp". Written out here (not read from SGLang) so the check is an
# independent statement of where each tensor must land.
_PREFIX_MAP = (("language_model.layers.", "language_model.model.layers."),)
_SUBSTR_MAP = (("block_sparse_moe", "mlp"),)


def runtime_name(ckpt_name: str) -> str:
    """The name a checkpoint tensor has in SGLang's model before fusion (its mapper's rules)."""
    for old, new in _PREFIX_MAP:
        if ckpt_name.startswith(old):
            ckpt_name = new + ckpt_name[len(old):]
    for old, new in _SUBSTR_MAP:
        ckpt_name = ckpt_name.replace(old, new)
    return ckpt_name


def read_config(ckpt: Path) -> dict[str, Any]:
    """config.json of ``ckpt`` (errors name the file)."""
    path = Path(ckpt) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json; is {ckpt} a checkpoint directory?") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (K3 nests it under text_config)."""
    return config.get("text_config", config)


class CheckpointReader:
    """Tensors of a safetensors checkpoint by name (``model.safetensors.index.json``)."""

    def __init__(self, ckpt: Path):
        self.root = Path(ckpt)
        index = self.root / INDEX_FILE
        try:
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except FileNotFoundError:
            raise FileNotFoundError(f"{index}: missing; the check reads the cast output's index") from None
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, shard: str) -> Any:
        from safetensors import safe_open

        if shard not in self._handles:
            path = self.root / shard
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard named by {INDEX_FILE} is missing")
            self._handles[shard] = safe_open(str(path), framework="pt")
        return self._handles[shard]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (dtype and shape of the file)."""
        shard = self.weight_map.get(name)
        if shard is None:
            raise KeyError(f"{self.root / INDEX_FILE}: no tensor {name!r}")
        return self._handle(shard).get_tensor(name)

    def shard_of(self, name: str) -> str:
        return self.weight_map[name]
