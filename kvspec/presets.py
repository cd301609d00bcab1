"""Model presets: KV-cache configs of real models, by Hugging Face repo id or alias."""

from kvspec.reference._presets import Layout, ModelPreset, get_preset, list_presets

__all__ = ["Layout", "ModelPreset", "get_preset", "list_presets"]
