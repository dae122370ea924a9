"""The book's figure style and the checks Run.glue_fig applies (kvlib.publish.figures)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvlib.publish import figures  # noqa: E402


@pytest.fixture(autouse=True)
def style():
    with matplotlib.rc_context():
        figures.apply_style()
        yield
        plt.close("all")


def test_the_first_24_series_all_look_different():
    looks = [(d["color"], d["marker"], d["linestyle"]) for d in figures.style_cycle()]
    assert len(looks) == 24 and len(set(looks)) == 24
    assert len({c for c, _, _ in looks[:8]}) == 8  # the first eight differ in colour alone too


def test_a_plain_figure_in_the_book_style_passes():
    fig, ax = plt.subplots()
    x = np.arange(10)
    for k in range(12):
        ax.plot(x, x * (k + 1), label=f"series {k}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    assert figures.figure_problems(fig) == []


def test_small_text_twin_series_and_a_legend_on_the_data_are_refused():
    fig, ax = plt.subplots(figsize=(16, 3))  # scaled to half in the column: 9.5 pt ticks become about 7 px
    ax.plot([0, 1], [0, 1], color="k", linestyle="-", marker="o", label="a")
    ax.plot([0, 1], [0.5, 0.5], color="k", linestyle="-", marker="o", label="b")
    ax.legend(loc="center")
    found = " | ".join(figures.figure_problems(fig))
    assert "text of" in found and "look the same" in found and "covers" in found


def test_glue_fig_refuses_a_figure_that_would_not_read(tmp_path, monkeypatch):
    from kvlib.publish import Run
    from kvlib.publish import run as run_module

    monkeypatch.setenv("KVLIB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(run_module, "_inline_figures", lambda: None)  # no notebook frontend in a test session
    run = Run("t", profile="ci")
    fig, ax = plt.subplots(figsize=(20, 2))
    ax.plot([0, 1], [0, 1], "k-o", label="a")
    ax.plot([0, 1], [1, 0], "k-o", label="b")
    ax.annotate("tiny", (0.5, 0.5), fontsize=4)
    with pytest.raises(ValueError, match="look the same"):
        run.glue_fig("fig_twins", fig)


def test_make_readable_enlarges_small_text_and_moves_a_legend_off_the_data():
    fig, ax = plt.subplots(figsize=(16, 3))
    ax.plot([0, 1], [0, 1], label="a")
    ax.plot([0, 1], [0.5, 0.5], label="b")
    ax.legend(loc="center")
    assert figures.figure_problems(fig)
    changed = figures.make_readable(fig)
    assert any("enlarged" in c for c in changed) and any("legend" in c for c in changed)
    assert figures.figure_problems(fig) == []


def test_tables_in_words():
    """Headers in words with units, booleans as yes/no (numpy's too), developer messages in words, no -0.00."""
    import pandas as pd

    from kvlib.publish.tables import fixed, in_words, plain, signed_percent

    df = pd.DataFrame({"B": [1, 2], "graph": [np.bool_(True), False], "reason": pd.array(
        ["hf-hqq-int4: cannot import hqq: ModuleNotFoundError: No module named 'hqq' (no wheels in .whl/)",
         "not timed (Profile.budget_methods: no room)"], dtype="string")})
    out = in_words(df)
    assert list(out.columns) == ["batch", "CUDA graph", "reason"]
    assert list(out["CUDA graph"]) == ["yes", "no"]
    assert out["reason"][0] == "the hqq package is not installed (it has no wheel for this Python)"
    assert out["reason"][1] == "not timed (no room)"
    assert list(in_words(df, rename=False).columns) == ["B", "graph", "reason"]
    assert fixed(2)(-0.001) == "0.00" and fixed(1)(1234.56) == "1,234.6" and fixed(2)(float("nan")) == "n/a"
    assert signed_percent(1)(-0.0004) == "+0.0%" and signed_percent(1)(0.123) == "+12.3%"
    assert plain("fine text") == "fine text"
    with pytest.raises(TypeError, match="df"):
        in_words([1, 2])


def test_header_words_relabels_headers_and_keeps_formats():
    import pandas as pd

    from kvlib.publish.tables import header_words, key_words

    html = header_words(pd.DataFrame({"kl_mean": [0.000123], "top1": [0.5]}).style.format({"kl_mean": "{:.2e}"}))
    html = html.to_html()
    assert "mean KL" in html and "top-1 agreement" in html and "1.23e-04" in html and "kl_mean" not in html
    assert key_words("kv4_intpv_max_abs_err_o") == "KV4, INT PV: max |Δ| of the output"
