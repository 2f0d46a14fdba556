"""`infercache` command line: the only place that reads argv and the environment.

    infercache serve [--config FILE] [--port N] [--frontends N] [--set section.field=value ...]
    infercache engines build|list|verify|prune [--runtime onnxruntime|tensorrt] [--model NAME]
    infercache cache stats|readers [--cache-dir DIR]
    infercache prepare-model [--models-dir DIR] [--force]
    infercache generate "question" [--model smollm2] [--address HOST:PORT] [--max-new-tokens N]
    infercache train-head data.csv --name NAME [--text-column text] [--label-column label] [--whole-graph]
    infercache synonyms check FILE
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "minilm"
DEFAULT_GENERATIVE_MODEL = "smollm2"
DEFAULT_VERSION = "1"


_FLAGS = (("host", "server.host"), ("port", "server.port"), ("frontends", "server.frontends"),
          ("models_dir", "server.models_dir"), ("cache_dir", "cache.dir"), ("engines_dir", "engines.dir"),
          ("runtime", "engines.runtime"), ("metrics_port", "server.metrics_port"))


def _config(args: argparse.Namespace):
    """The one place configuration is read: file, environment, flags. Exits 2 with the reason."""
    from server import config as config_mod

    overrides = dict(item.split("=", 1) for item in args.set)
    for flag, dotted in _FLAGS:
        if getattr(args, flag, None) is not None:
            overrides[dotted] = getattr(args, flag)
    try:
        return config_mod.load(args.config or os.environ.get("INFERCACHE_CONFIG"), os.environ, overrides)
    except config_mod.ConfigError as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# The server's numpy work is small (a head's matrix product, a batch's padding): OpenBLAS's own threads
# only spin beside the engine's and the event loops, and cost more CPU than the product (a head on a
# batch of 32 on a 2-core host: 694 us of CPU per call with them, 88 us with one thread). Set before
# numpy loads, so the processes the server spawns inherit it; an operator's own setting is kept.
BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1"}


def _serve(args: argparse.Namespace) -> int:
    for name, value in BLAS_THREADS.items():
        os.environ.setdefault(name, value)
    from server.shared.models import ModelConfigError, ModelRepository
    from server.supervisor import run

    config = _config(args)
    try:
        repository = ModelRepository(Path(config.server.models_dir))
    except ModelConfigError as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        return 2
    missing = [f"{m.name} version {m.serving_version}" for m in repository.models.values()
               if m.serving_version not in m.versions]
    if missing or not repository.models:
        print(f"infercache: no model files for {', '.join(missing) or 'any model'} in {repository.root}; "
              "run `infercache prepare-model` (or `make model`)", file=sys.stderr)
        return 2
    from server.worker.upstream.credentials import read_credential

    for spec in repository.servable():  # (each worker reads them again; a bad one is said here, once)
        if spec.upstream is not None:
            try:
                read_credential(spec.name, spec.upstream)
            except ModelConfigError as exc:
                print(f"infercache: {exc}", file=sys.stderr)
                return 2
    for spec in repository.models.values():
        if spec.semantic_off:
            print(f"infercache: {spec.name}: its semantic: section is off (no `enabled: true`): exact answers only",
                  file=sys.stderr)
    return run(config)


def _prepare_model(args: argparse.Namespace) -> int:
    """The default models into the repository: the sentence encoder, and the generative model where
    the repository has its config."""
    import logging

    from server.shared.generation_spec import DECODER_FILE, DECODER_WEIGHTS_FILE
    from server.shared.models import MODEL_FILE, load_model

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load_model(Path(args.models_dir) / DEFAULT_MODEL)
    target = spec.version_dir(DEFAULT_VERSION)
    if (target / MODEL_FILE).is_file() and not args.force:
        print(f"infercache: {target / MODEL_FILE} exists (use --force to export again)")
    else:
        from server.tools.export_model import default_encoder_dir, export_sentence_encoder

        print(f"infercache: exporting all-MiniLM-L6-v2 to {target} ...", flush=True)
        export_sentence_encoder(default_encoder_dir(), target, spec.max_tokens)
        print(f"infercache: wrote {target / MODEL_FILE}")
    generative = Path(args.models_dir) / DEFAULT_GENERATIVE_MODEL
    if not (generative / "config.yaml").is_file():
        return 0
    target = load_model(generative).version_dir(DEFAULT_VERSION)
    if all((target / name).is_file() for name in (DECODER_FILE, DECODER_WEIGHTS_FILE)) and not args.force:
        print(f"infercache: {target / DECODER_FILE} and {DECODER_WEIGHTS_FILE} exist (use --force to export again)")
        return 0
    from server.tools.export_decoder import default_gguf, export_decoder

    try:
        gguf = default_gguf()
    except FileNotFoundError as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        return 2
    export_decoder(gguf, target)
    print(f"infercache: wrote {target / DECODER_FILE}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    """Prints the answer as it streams, then how it ended and where it came from."""
    import grpc

    from infercache.client import Client
    from infercache.v1 import infercache_pb2 as pb

    try:
        token = Path(args.token_file).read_text().strip() or None if args.token_file else None
    except OSError as exc:
        print(f"infercache: --token-file: {exc}", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    try:
        with Client(args.address, timeout_s=600, token=token) as client:
            for message in client.generate_stream(args.model, messages=messages, max_new_tokens=args.max_new_tokens,
                                                  temperature=args.temperature, seed=args.seed):
                print(message.text, end="", flush=True)
                if message.HasField("end"):
                    end = message.end
                    print(f"\n[{pb.GenerationEnd.FinishReason.Name(end.finish_reason)}, {end.prompt_tokens} + "
                          f"{end.completion_tokens} tokens, {pb.CacheInfo.Source.Name(end.cache.source)}]")
    except grpc.RpcError as exc:
        print(f"\ninfercache: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _engines(args: argparse.Namespace) -> int:
    from server.tools import engine_cli

    return engine_cli.main(_config(args), args.engines_command, model=args.model, force=args.force,
                           dry_run=args.dry_run)


def _cache(args: argparse.Namespace) -> int:
    if args.cache_command in ("warm", "hot"):
        from server.tools import warm

        if not args.model:
            print(f"infercache: cache {args.cache_command} needs --model", file=sys.stderr)
            return 2
        token = None
        if args.token_file:  # a file, not a flag: a token on the command line is visible to `ps`
            try:
                token = Path(args.token_file).read_text().strip() or None
            except OSError as exc:
                print(f"infercache: --token-file: {exc}", file=sys.stderr)
                return 2
        if args.cache_command == "hot":
            return warm.run_hot(args.address, args.model, limit=args.limit, texts=args.texts, tenant=args.tenant,
                                token=token)
        if not args.file:
            print("infercache: cache warm needs a FILE of texts (one per line, or a CSV with --column)", file=sys.stderr)
            return 2
        return warm.run_warm(args.address, args.model, Path(args.file), column=args.column, batch=args.batch,
                             version=args.model_version, tenant=args.tenant, token=token)
    from server.tools import cache_cli

    config = _config(args)
    return cache_cli.run(config, args.cache_command)


def _synonyms(args: argparse.Namespace) -> int:
    from server.tools.synonyms_cli import check

    return check(Path(args.file))


class _DefaultsShown(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if action.default not in (None, False, [], "", argparse.SUPPRESS) and "%(default)" not in help_ \
                and action.option_strings:
            help_ += " (default: %(default)s)"
        return help_


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: $INFERCACHE_CONFIG)")
    parser.add_argument("--models-dir", help="the model repository (server.models_dir; default: models)")
    parser.add_argument("--engines-dir", help="L3 engine store (engines.dir)")
    parser.add_argument("--runtime", help="engines.runtime: onnxruntime or tensorrt")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override any setting, e.g. --set cache.budget_mb=512")


def _train_head(args: argparse.Namespace) -> int:
    from server.tools.labelled_csv import LabelledDataError
    from server.tools.train_head import TrainError, train

    try:
        train(Path(args.csv), text_column=args.text_column, label_column=args.label_column,
              models_dir=Path(args.models_dir), encoder=args.encoder, name=args.name, version=args.version,
              epochs=args.epochs, limit=args.limit, whole_graph=args.whole_graph)
    except (TrainError, LabelledDataError) as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        return 2
    return 0


def _share(text: str) -> float:
    share = float(text)
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"a share is in (0, 1], got {text}")
    return share


def _eval_semantic(args: argparse.Namespace) -> int:
    from server.tools.labelled_csv import LabelledDataError

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"eval-semantic-{args.model}-{stamp}.json")  # by default a new file, never a tracked one
    if args.folds and args.replay:
        print("infercache: --replay and --folds exclude each other (--folds replays folds of one file)", file=sys.stderr)
        return 2
    try:
        if args.folds:
            from server.tools.semantic_eval import main as evaluate

            evaluate(args.address, args.model, Path(args.csv), text_column=args.text_column,
                     label_column=args.label_column, folds=args.folds, limit=args.limit, out=out,
                     png=Path(args.png or out.with_suffix(".png")))
        else:
            from server.tools.semantic_heldout import main as evaluate

            evaluate(args.address, args.model, Path(args.csv), text_column=args.text_column,
                     label_column=args.label_column, limit=args.limit, holdout=args.holdout,
                     leave_out=args.leave_out_labels, out=out, novel_modes=tuple(args.novel_replay.split(",")),
                     replay_path=Path(args.replay) if args.replay else None, warm_share=args.warm_share)
    except LabelledDataError as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infercache", description="Inference cache sidecar")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser = functools.partial(commands.add_parser, formatter_class=_DefaultsShown)

    serve = commands.add_parser("serve", help="run the server (supervisor, frontends, worker)")
    _add_config_options(serve)
    serve.add_argument("--host", help="the address to serve on (server.host; default: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="the gRPC port (server.port; default: 50051)")
    serve.add_argument("--frontends", type=int, help="frontend processes (0 = one per CPU)")
    serve.add_argument("--cache-dir", help="the result store's folder (cache.dir; default: var/cache)")
    serve.add_argument("--metrics-port", type=int,
                       help="serve Prometheus metrics on GET /metrics at this port (server.metrics_port; 0 = off)")
    serve.set_defaults(func=_serve)

    engines = commands.add_parser("engines", help="the L3 engine store: build, list, verify, prune")
    engines.add_argument("engines_command", choices=("build", "list", "verify", "prune"))
    _add_config_options(engines)
    engines.add_argument("--model", help="build only this model (default: every servable model)")
    engines.add_argument("--force", action="store_true", help="build even if a verified artifact exists")
    engines.add_argument("--dry-run", action="store_true", help="prune: only say what would be removed")
    engines.set_defaults(func=_engines)

    generate = commands.add_parser("generate", help="stream a generative model's answer from a running server")
    generate.add_argument("prompt", help="the user's message")
    generate.add_argument("--model", default=DEFAULT_GENERATIVE_MODEL, help="a generative model of the server")
    generate.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC address")
    generate.add_argument("--system", help="a system message before it")
    generate.add_argument("--max-new-tokens", type=int, default=0, help="0: the model's default")
    generate.add_argument("--temperature", type=float, help="unset: the model's default (0: greedy)")
    generate.add_argument("--seed", type=int, help="makes a sampled answer reproducible (and cacheable)")
    generate.add_argument("--token-file", help="a file holding the bearer token, where tokens are on")
    generate.set_defaults(func=_generate)

    prepare = commands.add_parser("prepare-model", help="export the default models to the model repository")
    prepare.add_argument("--models-dir", default="models", help="the model repository to write to")
    prepare.add_argument("--force", action="store_true", help="export even if the files exist")
    prepare.set_defaults(func=_prepare_model)

    cache = commands.add_parser(
        "cache", help="the result store: stats per namespace, LMDB reader table; warm a server, its hot keys",
        epilog="warm and hot talk to a running server (--address); with tokens on, pass one with --token-file")
    cache.add_argument("cache_command", choices=("stats", "readers", "warm", "hot"))
    cache.add_argument("file", nargs="?", help="warm: texts, one per line, or a CSV file (see --column)")
    _add_config_options(cache)
    cache.add_argument("--cache-dir", help="stats, readers: the result store's folder (cache.dir)")
    cache.add_argument("--model", help="warm, hot: the model")
    cache.add_argument("--address", default="127.0.0.1:50051", help="warm, hot: the server")
    cache.add_argument("--column", help="warm: the CSV column of the texts (default: text)")
    cache.add_argument("--batch", type=int, default=32, help="warm: texts per InferBatch call")
    cache.add_argument("--tenant", default="", help="warm: the tenant to warm for; hot --texts: whose texts")
    cache.add_argument("--model-version", default="", help="warm: the model version (default: its serving one)")
    cache.add_argument("--limit", type=int, default=20, help="hot: how many keys (at most server.hot_keys)")
    cache.add_argument("--texts", action="store_true", help="hot: print the texts only (a warm file)")
    cache.add_argument("--token-file", help="warm, hot: a file holding the bearer token (hot needs an admin one)")
    cache.set_defaults(func=_cache)

    synonyms = commands.add_parser("synonyms", help="check a synonym dictionary (a model's normalize.synonyms)")
    synonyms.add_argument("synonyms_command", choices=("check",))
    synonyms.add_argument("file", help="the dictionary: 'phrase | phrase => canonical' per line")
    synonyms.set_defaults(func=_synonyms)

    head = commands.add_parser("train-head", help="train a classification head on an encoder from a labelled CSV")
    head.add_argument("csv", help="CSV file with a header row")
    head.add_argument("--name", required=True, help="model name to write (models/<name>/<version>)")
    head.add_argument("--text-column", default="text", help="the CSV column of the texts")
    head.add_argument("--label-column", default="label", help="the CSV column of the labels")
    head.add_argument("--encoder", default=DEFAULT_MODEL, help="encoder model in the repository")
    head.add_argument("--version", help="version to write (default: the next integer)")
    head.add_argument("--models-dir", default="models", help="the model repository (the encoder's and the head's)")
    head.add_argument("--epochs", type=int, default=300, help="training passes over the rows")
    head.add_argument("--limit", type=int, help="use only the first N rows")
    head.add_argument("--whole-graph", action="store_true",
                      help="write one ONNX graph of encoder + head (the format before the feature tier; its "
                           "misses run the whole encoder again) instead of a head on the encoder")
    head.set_defaults(func=_train_head)

    evaluate = commands.add_parser("eval-semantic", help="measure semantic hits and fidelity on a labelled CSV")
    evaluate.add_argument("csv", help="labelled CSV file with a header row")
    evaluate.add_argument("--model", required=True, help="the classification model to measure (a running server's)")
    evaluate.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC address")
    evaluate.add_argument("--text-column", default="text", help="the CSV column of the texts")
    evaluate.add_argument("--label-column", default="label", help="the CSV column of the labels")
    evaluate.add_argument("--holdout", type=int, default=5, help="replay every Nth row, warm with the rest")
    evaluate.add_argument("--replay", metavar="CSV",
                          help="instead of --holdout: every row of the first file warms the cache, this file's are replayed")
    evaluate.add_argument("--warm-share", type=_share, metavar="S",
                          help="only this share of the file's rows (0 < S <= 1, shuffled) warms the cache")
    evaluate.add_argument("--leave-out-labels", type=int, default=0, metavar="K",
                          help="every Kth label never warms the cache: its rows are replayed as novel queries")
    evaluate.add_argument("--novel-replay", default="static,streaming", choices=("static", "streaming", "static,streaming"),
                          help="how the left-out labels' rows are replayed: NO_STORE, DEFAULT, or both in that order")
    evaluate.add_argument("--folds", type=int, help="instead: k-fold replay of neighbours, consensus rules swept offline")
    evaluate.add_argument("--limit", type=int, help="use only the first N rows")
    evaluate.add_argument("--out", help="JSON report (default: a new eval-semantic-MODEL-TIME.json here)")
    evaluate.add_argument("--png", help="with --folds: the hits-vs-fidelity plot (default: beside --out)")
    evaluate.set_defaults(func=_eval_semantic)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [item for item in getattr(args, "set", []) if "=" not in item or "." not in item.split("=", 1)[0]]
    if bad:
        parser.error(f"--set expects SECTION.FIELD=VALUE, got {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
