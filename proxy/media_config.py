"""config.yaml's `proxy.media_urls`: which media URLs clients may make engines fetch (the knobs only; the
verdict on a request is proxy/security/media_urls.py's)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.cidrs import checked_cidrs


class MediaUrlPolicy(BaseModel):
    """config.yaml's `proxy.media_urls`: which image, video and audio URLs a client may make an engine fetch."""

    model_config = ConfigDict(extra="forbid")

    allowed_networks: list[str] = Field(default_factory=list, description=(
        "CIDRs off the public internet that http(s) media URLs may resolve to (an internal object store, say); "
        "public addresses are always allowed, loopback, private, link-local and the like only when listed here"))
    allow_file_urls: bool = Field(False, description=(
        "pass `file:` media URLs on (the engines must also allow a path: vLLM's --allowed-local-media-path)"))

    @field_validator("allowed_networks")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        return checked_cidrs(v)
