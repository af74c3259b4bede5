"""HTML pieces of the report: escaping, tables, figures, the page's style and script."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import polars as pl

from draco_cli.report.data import Redact

GREEN, RED = (34, 139, 34), (200, 40, 40)


def _esc(text: object, redact: Redact) -> str:
    return html.escape(redact(str(text))) if text is not None else ""


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "—" if v is None else format(v, fmt)


def _table(df: pl.DataFrame, formats: dict[str, str] | None = None, cls: str = "",
           nulls: dict[str, Callable[[dict[str, Any]], str]] | None = None) -> str:
    """``nulls``: what a null of a column says, given its row (else "—"): "unpriced" for
    the dollars of calls whose model has no price."""
    formats, nulls = formats or {}, nulls or {}
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = []
    for row in df.iter_rows(named=True):
        cells = []
        for c, v in row.items():
            if isinstance(v, float):
                cells.append(f"<td class='num'>{_num(v, formats.get(c, '.3f'))}</td>")
            elif isinstance(v, int):
                cells.append(f"<td class='num'>{v}</td>")
            else:
                text = (nulls[c](row) if c in nulls else "—") if v is None else str(v)
                cells.append(f"<td>{html.escape(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class='{cls}'><tr>{head}</tr>{''.join(body)}</table>"


def _fig_html(fig: Any, div_id: str | None = None, height: int = 360, top: int = 50) -> str:
    fig.update_layout(margin=dict(l=50, r=20, t=top, b=40), height=height,
                      template="plotly_white")
    html_text: str = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                                 config={"displaylogo": False, "responsive": True})
    return html_text


def _rgba(value: float | None, scale: float) -> str:
    if value is None or not scale:
        return "transparent"
    x = max(-1.0, min(1.0, value / scale))
    r, g, b = GREEN if x >= 0 else RED
    return f"rgba({r},{g},{b},{0.08 + 0.62 * abs(x):.2f})"


def _int_axis(fig: Any, xs: list[int], title: str = "train step") -> None:
    fig.update_xaxes(title=title, tickmode="array", tickvals=xs,
                     ticktext=[str(x) for x in xs])


CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em} h2{margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.88em;width:100%;table-layout:auto}
td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f6f6f6} td.num{text-align:right;white-space:nowrap}
pre{margin:0;white-space:pre-wrap;overflow-wrap:anywhere;font-size:.95em;max-height:24em;
    overflow:auto} pre.obs{color:#555;background:#fafafa}
table.steps td:nth-child(2){width:45%} table.steps td.judge{width:35%;font-size:.92em}
tr.dropped{color:#999} .dim{color:#999} .note{color:#555;font-size:.9em}
div.pass{color:#1b6e1b} div.fail{color:#a32020} details summary{cursor:pointer;color:#555}
.banner{background:#fdecea;border:1px solid #e0a3a0;padding:.8em 1em;border-radius:4px;
        margin:1em 0} .notice{background:#fff8e1;border:1px solid #e6c65c;padding:.8em 1em;
        border-radius:4px;margin:1em 0} .notice ul,.banner ul{margin:.4em 0 0 1em;padding:0}
.bar{display:inline-block;width:60px;height:.7em;background:#eee;vertical-align:middle}
.bar span{display:block;height:100%;background:#5a9bd5}
select{font-size:.95em;max-width:100%}
"""


SCRIPT = """
(function(){
  var pick = document.getElementById('pick');
  if (!pick) return;
  function show(i){
    document.querySelectorAll('div.rollout').forEach(function(d){ d.hidden = true; });
    var d = document.getElementById('rollout-' + i); if (d) d.hidden = false;
    pick.value = String(i);
  }
  pick.addEventListener('change', function(){ show(pick.value); });
  var heat = document.getElementById('heatmap');
  if (heat && heat.on) heat.on('plotly_click', function(ev){
    var id = ev.points[0].y;
    for (var i = 0; i < pick.options.length; i++)
      if (pick.options[i].text.indexOf(id + ' — ') === 0) { show(i);
        document.getElementById('rollout-' + i).scrollIntoView({behavior: 'smooth'}); break; }
  });
})();
"""
