"""DeepSpeed glue: initialize, engine wrapper, model conversion, expert optimizer, checkpoints."""
