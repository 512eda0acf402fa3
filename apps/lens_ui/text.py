"""Text from run directories on the page as text (docs/architecture.md §5, run text).

Run names, config values, provenance and the error messages that quote them come from files anyone with write access
to the runs folder controls. Streamlit renders titles, captions, messages and radio options as Markdown, and Plotly
renders figure titles and legends as a subset of HTML: unescaped, `![x](http://…)` in a provenance field would become
an image the browser fetches. Every run-derived value goes through `plain` (Markdown) or `figure_text` (Plotly).
"""

from __future__ import annotations

import html
import re

# CommonMark lets a backslash escape any ASCII punctuation character. Escaped everywhere: the characters that open
# Markdown and GFM syntax anywhere in a line (emphasis, code, links and images, HTML and autolinks, tables,
# strikethrough, entities) and Streamlit's own (`:red[…]`, `:material/…:`, emoji shortcodes, `$…$` maths).
_ANYWHERE = re.compile(r"([\\`*_\[\]<>#|~$:&!(){}+=^@])")
# Special only at the start of a line, so escaped only there (paths and run names stay legible in the page's
# source): "-" (a list item, a thematic break, a setext underline) and "1." (an ordered list item).
_DASH_AT_LINE_START = re.compile(r"^([ \t]*)-", re.MULTILINE)
_NUMBER_AT_LINE_START = re.compile(r"^([ \t]*\d+)\.", re.MULTILINE)
# Some syntax survives escaping, because GFM and Streamlit find it in the parsed text (or, for `:material/`, in the
# source before parsing): URLs, "www." hosts and e-mail addresses become links; `:name:` emoji, `:material/…:` icons
# and `:streamlit:` become pictures; "->", "<-", "<->", "--", ">=", "<=" and "~=" between spaces become arrows and
# symbols. An invisible word joiner after each colon, after "www" and "@", and inside each of those symbols leaves
# the text as it reads and none of them.
WORD_JOINER = "\u2060"
_SYMBOLS = ("<->", "->", "<-", "--", ">=", "<=", "~=")  # Streamlit's typography, each between spaces
_SYMBOL_STARTS = "|".join(rf"{re.escape(symbol[0])}(?={re.escape(symbol[1:])}(?:\s|$))" for symbol in _SYMBOLS)
_FOUND_IN_TEXT = re.compile(rf"(?i)(:|www(?=\.)|@|(?<!\S)(?:{_SYMBOL_STARTS}))")


def plain(value: object) -> str:
    """Markdown that shows `str(value)` literally (for Streamlit's titles, captions, messages, radio options)."""
    text = _FOUND_IN_TEXT.sub(lambda match: match[1] + WORD_JOINER, str(value))
    text = _ANYWHERE.sub(r"\\\1", text)
    text = _DASH_AT_LINE_START.sub(r"\1\\-", text)
    return _NUMBER_AT_LINE_START.sub(r"\1\\.", text)


def figure_text(value: object) -> str:
    """Plotly text (titles, trace names) that shows `str(value)` literally: its HTML subset escaped."""
    return html.escape(str(value))
