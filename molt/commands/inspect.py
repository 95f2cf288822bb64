"""``molt inspect``: a recorded Arrow file or folder, summarised (molt.runtime.recording)."""

from __future__ import annotations

import click


@click.command("inspect")
@click.argument("file", type=click.Path())
@click.option("--tokenizer", help="a model folder or name whose tokenizer decodes token_ids")
@click.option("--samples", type=int, default=1, help="sample rows to show")
def command(file: str, tokenizer: str | None, samples: int) -> int:
    """Summarise a recorded Arrow file: columns, sample rows."""
    from molt.runtime.recording import summarize

    decoder = None
    if tokenizer:
        from transformers import AutoTokenizer

        from molt.models import resolve_model

        decoder = AutoTokenizer.from_pretrained(resolve_model(tokenizer))
    click.echo(summarize(file, decoder, samples))
    return 0
