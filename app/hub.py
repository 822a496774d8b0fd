"""Search and browse the hub for MoE models, through `huggingface_hub.HfApi`.

A search asks the hub for models with their `config` (architecture, quantization), `safetensors`
parameter counts, tags and card data, then keeps the Mixture-of-Experts ones and tells, for each,
whether FreeToken can run it — the same two tables the engine and the converter use
(`runtime.models.base.FAMILY_MODULES`, `runtime.ftw.architectures`, `runtime.ftw.sources.detect_quantization`),
so "supported" here means the download will convert and load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.downloads import select_files

log = logging.getLogger(__name__)

# MoE model_types the hub knows, ours among them; anything else whose model_type says "moe" counts too.
KNOWN_MOE_TYPES = frozenset({
    "qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss", "mixtral", "qwen2_moe", "deepseek_v2",
    "deepseek_v3", "olmoe", "granitemoe", "glm4_moe", "ernie4_5_moe", "jamba", "dbrx", "phimoe", "minimax",
    "llama4", "hunyuan_v1_moe", "bailing_moe", "dots1", "kimi_k2", "glm4v_moe", "qwen3_vl_moe", "gpt_oss_moe",
})
EXPAND = ["author", "config", "safetensors", "tags", "downloads", "likes", "lastModified", "gated", "cardData",
          "library_name", "pipeline_tag", "sha"]
QUANT_CHOICES = ("none", "fp8", "mxfp4", "nvfp4")


class HubError(RuntimeError):
    """A hub request that failed, in words (not found, gated, unreachable)."""


def model_type_of(config: dict | None) -> str:
    config = config or {}
    text = config.get("text_config") or {}
    return str(config.get("model_type") or text.get("model_type") or "")


def is_moe(config: dict | None) -> bool:
    mt = model_type_of(config)
    return mt in KNOWN_MOE_TYPES or "moe" in mt


def quantization_of(config: dict | None) -> str:
    """'none' | 'fp8' | 'mxfp4' | 'nvfp4' | the hub's own name for anything else ('awq', 'gptq', ...)."""
    config = config or {}
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "NVFP4":
        return "nvfp4"
    if method == "compressed-tensors":
        formats = {str(qc.get("format", ""))} | {str(g.get("format", "")) for g in (qc.get("config_groups") or {}).values()}
        if "nvfp4-pack-quantized" in formats:
            return "nvfp4"
    return method or "unknown"


def support_check(config: dict | None, *, has_safetensors: bool) -> tuple[bool, str]:
    """Whether FreeToken can convert and run a repo with this config; the reason when it cannot."""
    from runtime.ftw import architectures
    from runtime.ftw.errors import FTWError
    from runtime.ftw.sources import detect_quantization
    from runtime.models.base import FAMILY_MODULES

    if not config:
        return False, "no config.json (not a transformers checkpoint)"
    mt = model_type_of(config)
    if mt not in FAMILY_MODULES or architectures.lookup(mt) is None:
        kind = "MoE architecture" if is_moe(config) else "architecture (not a MoE FreeToken runs)"
        return False, f"{kind} {mt or '?'} is not supported; FreeToken runs {', '.join(sorted(FAMILY_MODULES))}"
    if not has_safetensors:
        return False, "no safetensors weights (GGUF or pickle-only repos cannot be converted)"
    try:
        detect_quantization(Path("/nonexistent"), config)
    except FTWError as exc:
        return False, str(exc).replace("config.json: ", "")
    return True, "supported"


@dataclass
class HubModel:
    repo: str
    author: str = ""
    downloads: int = 0
    likes: int = 0
    last_modified: str = ""
    tags: list[str] = field(default_factory=list)
    pipeline_tag: str = ""
    library: str = ""
    model_type: str = ""
    architectures: list[str] = field(default_factory=list)
    quantization: str = "none"
    safetensors: bool = False
    params: int | None = None          # from the hub's safetensors metadata
    gated: bool = False
    licence: str = ""
    supported: bool = False
    reason: str = ""

    def line(self) -> str:
        mark = "ok " if self.supported else "-- "
        params = f"{self.params / 1e9:.1f}B" if self.params else "?"
        return (f"{mark}{self.repo:<50} {self.model_type:<18} {self.quantization:<6} {params:>7} "
                f"{self.downloads:>9,} dl" + ("" if self.supported else f"  ({self.reason})"))


@dataclass
class HubFile:
    path: str
    size: int | None
    sha256: str | None = None


@dataclass
class HubModelDetails(HubModel):
    revision: str = ""
    files: list[HubFile] = field(default_factory=list)
    card: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def download_size(self, allow_patterns: list[str] | None = None, ignore_patterns: list[str] | None = None) -> int:
        keep = set(select_files([f.path for f in self.files], allow_patterns, ignore_patterns))
        return sum(f.size or 0 for f in self.files if f.path in keep)


def _from_info(info: Any) -> dict[str, Any]:
    config = getattr(info, "config", None) or {}
    card = getattr(info, "card_data", None) or getattr(info, "cardData", None) or {}
    card = card.to_dict() if hasattr(card, "to_dict") else dict(card)
    tags = list(getattr(info, "tags", None) or [])
    st = getattr(info, "safetensors", None)
    has_st = bool(st) or "safetensors" in tags or any(
        s.rfilename.endswith(".safetensors") for s in (getattr(info, "siblings", None) or []))
    licence = card.get("license") or next((t.split(":", 1)[1] for t in tags if t.startswith("license:")), "")
    ok, reason = support_check(config, has_safetensors=has_st)
    modified = getattr(info, "last_modified", None)
    return dict(repo=info.id, author=info.author or info.id.split("/")[0], downloads=info.downloads or 0,
                likes=info.likes or 0, last_modified=modified.isoformat() if modified else "", tags=tags,
                pipeline_tag=info.pipeline_tag or "", library=info.library_name or "",
                model_type=model_type_of(config), architectures=list(config.get("architectures") or []),
                quantization=quantization_of(config), safetensors=has_st,
                params=int(st.total) if st else None, gated=bool(info.gated), licence=str(licence),
                supported=ok, reason=reason)


class HubBrowser:
    """Hub search for the library: a thin, testable layer over HfApi (endpoint = the mirror setting)."""

    def __init__(self, *, endpoint: str | None = None, token: str | bool | None = None):
        from huggingface_hub import HfApi

        self.endpoint = (endpoint or "").rstrip("/") or None
        self.token = token
        self.api = HfApi(endpoint=self.endpoint, token=token)

    def search(self, query: str = "", *, author: str | None = None, model_types: list[str] | None = None,
               quantization: str | None = None, safetensors_only: bool = True, supported_only: bool = False,
               sort: str = "downloads", limit: int = 20) -> list[HubModel]:
        """MoE models matching `query`, most downloaded first; filters apply to config.json's fields."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        if quantization is not None and quantization not in QUANT_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANT_CHOICES)} (got {quantization!r})")
        tag_filter = [model_types[0]] if model_types and len(model_types) == 1 else None
        found: list[HubModel] = []
        try:
            # The hub cannot filter on most config fields, so ask for more than we show and filter here.
            for info in self.api.list_models(search=query or None, author=author, filter=tag_filter, sort=sort,
                                             limit=max(limit * 5, 50), expand=EXPAND):
                config = getattr(info, "config", None) or {}
                if not is_moe(config):
                    continue
                if model_types and model_type_of(config) not in model_types:
                    continue
                model = HubModel(**_from_info(info))
                if quantization and model.quantization != quantization:
                    continue
                if safetensors_only and not model.safetensors:
                    continue
                if supported_only and not model.supported:
                    continue
                found.append(model)
                if len(found) >= limit:
                    break
        except HfHubHTTPError as exc:
            raise HubError(f"hub search failed: {str(exc).splitlines()[0]}") from exc
        except (OSError, httpx2.TransportError) as exc:
            raise HubError(f"cannot reach the hub at {self.endpoint or 'huggingface.co'} ({exc})") from exc
        return found

    def details(self, repo: str, *, revision: str | None = None) -> HubModelDetails:
        """One repo: its files with sizes and checksums, the card basics and the support verdict."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        from app.downloads import _http_reason

        try:
            info = self.api.model_info(repo, revision=revision, files_metadata=True)
        except HfHubHTTPError as exc:
            raise HubError(f"{repo}: {_http_reason(exc)}") from exc
        except (OSError, httpx2.TransportError) as exc:
            raise HubError(f"cannot reach the hub at {self.endpoint or 'huggingface.co'} ({exc})") from exc
        base = _from_info(info)
        files = [HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or []]
        card = getattr(info, "card_data", None)
        card = card.to_dict() if hasattr(card, "to_dict") else dict(card or {})
        return HubModelDetails(**base, revision=info.sha or "", files=files, card=card,
                               config=dict(getattr(info, "config", None) or {}))
