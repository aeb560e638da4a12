"""``cdbench fit-predictor``: the command-line face of :mod:`cdbench.profile.fit_predictor`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cdbench.cli.support import console, fail, user_errors


def fit_predictor(
    store: Annotated[Path | None, typer.Option(help="Spec-cost store folder (cdbench measure-specs --store): "
                                                    "fitted on its entries of this host.")] = None,
    data: Annotated[Path | None, typer.Option(help="Folder of cdbench profile output folders: fitted on "
                                                   "without --store, compared with the store beside it.")] = None,
    vocab: Annotated[str, typer.Option(help="Vocabulary of the entries to fit on.")] = "qwen3.6",
    out_dir: Annotated[Path | None, typer.Option(help="Folder of the predictor files (default: the shipped "
                                                      "ones, cdbench/harness/costs/predictors).")] = None,
    table: Annotated[Path, typer.Option(help="Markdown file of the held-out errors.")] =
        Path("reports/spec_costs/heldout_errors.md"),
) -> None:
    """Fit each backend's spec-cost predictor (compile time, mean fill and failure rates from a spec's
    features) and write it, with the held-out error by backend and kind beside a per-kind median's.

    Example: cdbench fit-predictor --store .cache/spec_store_dev
    """
    from cdbench.harness.costs.spec_predictor import PREDICTOR_DIR
    from cdbench.profile.fit_predictor import FitError, fit_predictors

    with user_errors():
        try:
            result = fit_predictors(store, data, vocab, out_dir if out_dir is not None else PREDICTOR_DIR)
        except FitError as err:
            raise fail(str(err)) from None
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(result.text, encoding="utf-8")
    for path in result.paths:
        console.print(f"wrote {path}", highlight=False)
    console.print(result.text, highlight=False, markup=False)
    console.print(f"table: {table}", highlight=False)
