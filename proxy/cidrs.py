"""The one check of a config's CIDR lists (worker networks, media URL networks): each entry must parse."""

from __future__ import annotations

import ipaddress


def checked_cidrs(values: list[str]) -> list[str]:
    """`values` unchanged when each is a CIDR network (host bits allowed); ValueError names the first that is not."""
    for cidr in values:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValueError(f"not a CIDR network: {cidr!r}") from None
    return values
