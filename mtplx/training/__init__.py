"""Training an MTP head for a checkpoint that has none (`mtplx train-head`), by self-distillation
on the target's own text; shared pieces of the shipped model's training script."""
