"""Kubernetes' own syntax rules for what the CRD schema cannot check. Pure.

Label keys (a selector's map keys cannot carry a schema pattern on Kubernetes 1.20, and a
key's prefix and name have lengths of their own) and side-channel hosts (an IP or a DNS
name) are validated as Kubernetes validates them for its own kinds, so that an object that
could never work is refused when it is applied instead of silently matching nothing. Label
values and object names are patterns in the CRDs. Each function returns None when the value
is valid, else what was expected (the caller adds the field path and the value found).
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["dns_subdomain", "host", "label_key"]

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

LABEL_NAME_MAX = 63
DNS_SUBDOMAIN_MAX = 253
DNS_LABEL_MAX = 63


def label_key(key: str) -> str | None:
    """A label key: ``[prefix/]name``, name <= 63 alphanumerics, '-', '_', '.' (starting and
    ending alphanumeric), prefix a DNS subdomain <= 253."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or dns_subdomain(prefix) is not None):
        return (f"a label key whose prefix before '/' is a DNS subdomain (lowercase "
                f"alphanumerics, '-' and '.', at most {DNS_SUBDOMAIN_MAX} characters)")
    if not name or len(name) > LABEL_NAME_MAX or not _NAME.fullmatch(name):
        return (f"a label key ([prefix/]name, name at most {LABEL_NAME_MAX} alphanumerics, "
                "'-', '_' or '.', starting and ending alphanumeric)")
    return None


def dns_subdomain(name: str) -> str | None:
    """An object name (RFC 1123 subdomain): lowercase alphanumerics, '-' and '.', <= 253,
    every dot-separated label <= 63."""
    if (len(name) <= DNS_SUBDOMAIN_MAX and _DNS_SUBDOMAIN.fullmatch(name)
            and all(len(label) <= DNS_LABEL_MAX for label in name.split("."))):
        return None
    return (f"a DNS subdomain name (lowercase alphanumerics, '-' and '.', starting and ending "
            f"alphanumeric, at most {DNS_SUBDOMAIN_MAX} characters)")


def host(value: str) -> str | None:
    """An IP address (v4 or v6, no brackets) or a DNS name, without a port."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    if dns_subdomain(value.lower()) is None and not value.replace(".", "").isdigit():
        return None
    hint = "; the port goes in spec.sideChannel.port" if ":" in value else ""
    return ("an IP address or a DNS name without a port (e.g. 10.0.3.7 or "
            f"prefill-0.prefill.ns.svc){hint}")
