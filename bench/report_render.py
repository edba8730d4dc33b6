"""The storage-tier report written out: one self-contained HTML file (plots as inline PNG), or Markdown with
its plots beside it."""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Iterable

from gpufeed.bench.report_model import Block, Plot, Report, Table


_CSS = """
body{font-family:system-ui,-apple-system,'DejaVu Sans',sans-serif;margin:2em auto;max-width:1150px;color:#222;
line-height:1.45;padding:0 1em}
h1{margin-bottom:.1em}.sub{color:#666;margin-top:0}
h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.86em;display:block;overflow-x:auto}
th,td{border:1px solid #ccc;padding:.25em .55em;text-align:left;vertical-align:top}
th{background:#f3f3f3}tr:nth-child(even) td{background:#fafafa}
caption{text-align:left;font-weight:600;padding:.3em 0}
.note{color:#555;font-size:.85em;margin-top:-.8em}
.verdict-confirmed{color:#17692b;font-weight:700}.verdict-refuted{color:#a11;font-weight:700}
.verdict-no,.verdict-inconclusive{color:#777;font-weight:700}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:.85em}
"""


def _inline(text: str) -> str:
    """Escape, then render **bold** and `code` (the only inline markup the report's sentences use)."""
    out = html.escape(text)
    parts = out.split("**")
    out = "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))
    parts = out.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def table_html(t: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = []
    for row in t.rows:
        cells = []
        for c in row:
            cls = ""
            if c in ("CONFIRMED", "REFUTED", "NO DATA", "INCONCLUSIVE"):
                cls = f' class="verdict-{c.split()[0].lower()}"'
            cells.append(f"<td{cls}>{_inline(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    note = f'<p class="note">{_inline(t.note)}</p>' if t.note else ""
    return (f"<table><caption>{html.escape(t.title)}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>{note}")


def blocks_html(blocks: Iterable[Block]) -> str:
    """HTML for a section's blocks (paragraphs, bullet lists, tables, plots as inline PNG)."""
    parts = []
    for b in blocks:
        if isinstance(b, str):
            parts.append(f"<p>{_inline(b)}</p>")
        elif isinstance(b, list):
            parts.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in b) + "</ul>")
        elif isinstance(b, Table):
            parts.append(table_html(b))
        elif isinstance(b, Plot):
            data = base64.b64encode(b.png).decode("ascii")
            parts.append(f"<figure><img alt=\"{html.escape(b.title)}\" src=\"data:image/png;base64,{data}\">"
                         f"<figcaption>{html.escape(b.title)}</figcaption></figure>")
    return "\n".join(parts)


def render_html(report: Report) -> str:
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(report.title)}"
             f"</title><style>{_CSS}</style></head><body><h1>{html.escape(report.title)}</h1>"
             f"<p class=\"sub\">{html.escape(report.subtitle)}</p>"]
    for s in report.sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        parts.append(blocks_html(s.blocks))
    parts.append("</body></html>")
    return "\n".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report, asset_dir: str, asset_url: str) -> str:
    """Markdown with each plot written as a PNG in ``asset_dir`` and linked as ``asset_url/<name>.png``."""
    lines = [f"# {report.title}", "", f"_{report.subtitle}_", ""]
    n = 0
    for s in report.sections:
        lines += [f"## {s.title}", ""]
        for b in s.blocks:
            if isinstance(b, str):
                lines += [b, ""]
            elif isinstance(b, list):
                lines += [f"- {x}" for x in b] + [""]
            elif isinstance(b, Table):
                lines += [f"**{b.title}**", "", "| " + " | ".join(map(_md_cell, b.columns)) + " |",
                          "|" + "---|" * len(b.columns)]
                lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in b.rows]
                lines += ["", f"_{b.note}_", ""] if b.note else [""]
            elif isinstance(b, Plot):
                n += 1
                name = f"plot{n}.png"
                os.makedirs(asset_dir, exist_ok=True)
                with open(os.path.join(asset_dir, name), "wb") as f:
                    f.write(b.png)
                lines += [f"![{b.title}]({asset_url}/{name})", ""]
    return "\n".join(lines)
