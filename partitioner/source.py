"""Where the model's code made a graph node, read from the stack trace torch.export records (for messages: errors,
refusals, verify, dumps)."""

from __future__ import annotations

import re

import torch

_FRAME = re.compile(r'\s*File "(.+)", line (\d+), in (\S+)')


def source_line(node: torch.fx.Node) -> str:
    """Where the model's code made ``node`` ("attention_processor.py:1234 in forward: code"), from the stack trace
    export records; the innermost frame."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _FRAME.match(lines[i])
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            return f"{match[1].rsplit('/', 1)[-1]}:{match[2]} in {match[3]}" + (f": {code}" if code else "")
    return "no source line recorded"
