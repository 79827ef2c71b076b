"""Chat templates shipped inside the package, found by name wherever Zephon is installed.

``load_chat_template("chatml")`` and ``zephon shard --chat-template chatml`` use the copy in
the installed package (``loader/chat/templates/``; the repository's ``templates/chat/`` links
to the same files), so an SFT job runs from a wheel without a checkout. A path that exists
always wins over a shipped name.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Optional

from loader.errors import ChatTemplateError

# Name -> file in loader/chat/templates/.
SHIPPED_TEMPLATES = {
    "chatml": "chatml.jinja",  # ChatML with tools, tool calls, reasoning; {% generation %} tags
}


def shipped_template_path(name: str) -> str:
    """The installed file of shipped template ``name`` (a key of :data:`SHIPPED_TEMPLATES`)."""
    if name not in SHIPPED_TEMPLATES:
        raise ChatTemplateError(f"no shipped chat template {name!r}; shipped: {sorted(SHIPPED_TEMPLATES)} "
                                "(or pass the path of a .jinja file or a tokenizer_config.json)")
    return str(resources.files("loader.chat") / "templates" / SHIPPED_TEMPLATES[name])


def resolve_template(path: str) -> Optional[str]:
    """The shipped file ``path`` names when it is a shipped name and not an existing file, else None."""
    if path in SHIPPED_TEMPLATES and not os.path.exists(path):
        return shipped_template_path(path)
    return None
