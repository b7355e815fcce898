"""A mkdocs hook: a Sphinx role left in a rendered page (``:class:`~shardformer.X```: mkdocstrings renders
Markdown, not reStructuredText) is a warning, which ``strict: true`` turns into a failed build."""

import logging
import re

log = logging.getLogger("mkdocs.hooks.raw_roles")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj|ref):(?:`|<code>)[^<`]*")


def on_page_content(html, page, config, files):
    for found in sorted(set(ROLE.findall(html))):
        log.warning(
            "%s shows a raw Sphinx role %s: write it as Markdown (`Name` or [Name][path])", page.file.src_path, found
        )
    return html
