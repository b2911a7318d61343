"""The manifest digest: sha256 over the canonical JSON document and every kernel's source bytes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    """The document as canonical UTF-8 JSON: sorted keys, no whitespace, no ASCII escaping.

    Lone surrogates (legal in JSON's \\u escapes, illegal in UTF-8) pass through as their raw
    code units, so every document that parses has a digest.
    """
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", errors="surrogatepass")


def compute_digest(doc: Mapping[str, Any], kernel_sources: Mapping[str, bytes]) -> str:
    """sha256 hex of canonical_json(doc), then per kernel sorted by name: \\0kernel\\0 name \\0 source.

    `kernel_sources` maps kernel name -> the source file's bytes. Key order and whitespace of the
    file do not change the digest; any byte of any kernel source does.
    """
    h = hashlib.sha256(canonical_json(doc))
    for name in sorted(kernel_sources):
        h.update(b"\0kernel\0" + name.encode("utf-8", errors="surrogatepass") + b"\0")
        h.update(kernel_sources[name])
    return h.hexdigest()


def part_digests(doc: Mapping[str, Any], kernel_sources: Mapping[str, bytes]) -> tuple[str, ...]:
    """`<part>=<sha256 hex, 16 digits>` of each part the digest covers: each top-level key of the document, and
    `source:<kernel>` each kernel's source, in name order; two manifests of one digest have the same parts, and
    the parts that differ say where two of different digests do (`parts_differing`)."""
    parts = [f"{key}={hashlib.sha256(canonical_json({key: doc[key]})).hexdigest()[:16]}" for key in sorted(doc)]
    parts += [f"source:{name}={hashlib.sha256(code).hexdigest()[:16]}" for name, code in sorted(kernel_sources.items())]
    return tuple(parts)


def parts_differing(theirs: tuple[str, ...], ours: tuple[str, ...]) -> list[str]:
    """The parts (part_digests) in which two manifests differ, as words: `programs`, `the source of kernel 'k'`;
    a part one of them lacks too."""
    a, b = (dict(p.rpartition("=")[::2] for p in side) for side in (theirs, ours))
    return [f"the source of kernel {key[7:]!r}" if key.startswith("source:") else key
            for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)]
