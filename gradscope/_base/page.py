"""The HTML page skeleton every gradscope page shares, and text made safe inside it: no gradscope
imports, so the recording's, the comparison's and a job's pages (in different layers) all build on it.

Example:
    >>> page = document("a < b", "<p>hi</p>\\n")
    >>> "<title>a &lt; b</title>" in page and "default-src 'none'" in page
    True
    >>> _inline_json({"s": "</script>"})
    '{"s":"\\\\u003c/script\\\\u003e"}'
"""

from __future__ import annotations

import html as _html
import json
from typing import Any

__all__ = ["CSP", "document"]

# NOTE [ no network in pages ]: the page's Content-Security-Policy allows inline script and
# style and data:/blob: images only, so a page cannot fetch anything even if some code tried.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data: blob:; font-src data:"
)


def _inline_json(payload: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: ``<``, ``>`` and ``&`` are escaped
    as ``\\u003c`` etc., so no text in the data can close the element or open a comment."""
    text = json.dumps(payload, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _inline_script(js: str) -> str:
    """Script text safe inside ``<script>``: no ``</script`` and no ``<!--`` can end it early."""
    return js.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT").replace("<!--", "<\\!--")


def document(title: str, body: str, csp: str = CSP) -> str:
    """The page skeleton every gradscope page shares: ``body`` (HTML made safe by its maker) under
    a head with the Content-Security-Policy ``csp`` (NOTE [ no network in pages ]; a page that runs
    no script passes one that allows none) and the escaped ``title``."""
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_html.escape(title)}</title>\n"
        "<style>body { margin: 12px; background: #f5f7fa; }</style>\n"
        f"</head>\n<body>\n{body}</body>\n</html>\n"
    )


