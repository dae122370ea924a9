"""Small fixes to what Jupyter Book 1's stack puts into each page (a local Sphinx extension, see _config.yml).

sphinx-thebe (and sphinx-togglebutton) register their inline scripts twice, once with filename None and once with
"", so Sphinx's own duplicate check misses them; every page declared ``const THEBE_JS_URL`` twice, and the
browser's second declaration throws: an uncaught error on every page (kvlib.publish.browser fails on it). Each
script is kept once.
"""


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen, kept = set(), []
    for s in context.get("script_files", []):
        attrs = getattr(s, "attributes", {}) or {}
        key = (str(getattr(s, "filename", s) or ""), tuple(sorted((k, str(v)) for k, v in attrs.items() if k != "priority")))
        if key not in seen:
            seen.add(key)
            kept.append(s)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", _dedupe_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
