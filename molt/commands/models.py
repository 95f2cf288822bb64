"""``molt models``: prepare, upcycle and vlm (molt.models)."""

from __future__ import annotations

from pathlib import Path

import click

SEED = click.option("--seed", type=int, default=0, help="seed of the new weights")


@click.group("models")
def command() -> None:
    """Model utilities: prepare, upcycle, vlm."""


@command.command("prepare")
@click.argument("name", default="smollm2-135m-instruct")
def _prepare(name: str) -> int:
    """Convert a model into a local Hugging Face folder."""
    from molt.models import prepare

    click.echo(prepare(name))
    return 0


@command.command("upcycle")
@click.argument("source")
@click.argument("out", type=click.Path())
@click.option("--experts", type=int, default=4, help="experts per layer (E)")
@click.option("--top-k", type=int, default=2, help="experts per token (k)")
@SEED
def _upcycle(source: str, out: str, experts: int, top_k: int, seed: int) -> int:
    """Turn a dense Llama-style model into a Mixtral-style MoE.

    The same logits: each MLP copied into every expert, a new router. SOURCE: a folder, hub id
    or built-in name.
    """
    from molt.models import resolve_model
    from molt.models.upcycle import upcycle

    click.echo(upcycle(resolve_model(source), Path(out), experts, top_k, seed))
    return 0


@command.command("vlm")
@click.argument("source")
@click.argument("out", type=click.Path())
@click.option("--image-size", type=int, default=64, help="side of the processed image (px)")
@click.option("--patch-size", type=int, default=16, help="side of a vision patch (px)")
@click.option("--vision-hidden", type=int, default=256, help="width of the vision tower")
@click.option("--vision-layers", type=int, default=4, help="layers of the vision tower")
@SEED
@click.option("--vision-tower", help="a pretrained CLIP model (folder or hub id, e.g. "
              "openai/clip-vit-large-patch14-336) instead of a fresh tower; the sizes are its own")
def _vlm(source: str, out: str, image_size: int, patch_size: int, vision_hidden: int,
         vision_layers: int, seed: int, vision_tower: str | None) -> int:
    """Make a text model (dense or MoE) a LLaVA-style VLM.

    A fresh CLIP tower and projector. SOURCE: a Llama, Mistral or Mixtral folder, hub id or
    built-in name.
    """
    from molt.models import resolve_model
    from molt.models.vlm import build_vlm

    tower = resolve_model(vision_tower) if vision_tower else None
    click.echo(build_vlm(resolve_model(source), Path(out), image_size, patch_size, vision_hidden,
                         vision_layers, seed, tower))
    return 0
