"""The ``node.meta`` vocabulary: the keys analyses write and later passes, executors and tools read, and the
helpers that keep a node's value (``meta["val"]``) right after a rewrite."""

from __future__ import annotations

from torch import fx

# node.meta keys written by analyses and read by later passes
SHARD_OF = "shard_of"  # fully_shard: index of the parameter this value is a shard of (grads, state, updates)
SHARDED_PARAM = "sharded_param"  # fully_shard: a parameter placeholder that holds a shard
EXPERT_BLOCK = "expert_block"  # expert parallel: the rank's block of experts read from its own shard (no gather)
PARTIAL_NORM = "partial_norm"  # fully_shard: a 2-norm of a shard (its position among the step's norms)
DEDUP_KEY = "dedup_key"  # what else two identical collectives must share to be merged (e.g. the phase)
GRADIENT_OF = "gradient_of"  # a gradient's collective (all-reduce / reduce-scatter): the parameter index
ACTIVATION_COLLECTIVE = "activation_collective"  # expand mode: a collective whose result the step computes on
PARTIAL_FOUND_INF = "partial_found_inf"  # fully_shard: a GradScaler's inf flag over this rank's gradient shards
EAGER_LAYOUT_UNKNOWN = "eager_layout_unknown"  # a random op whose inputs' eager layout no probe could find
COMPUTED_INDEX = "computed_index"  # an index a pass computed from sizes, in range by construction: not bounds-checked
# node.meta["custom"] key (the trace writes it, the functionalizing re-trace keeps it): the call a user wrote that
# the trace computed with this node, where the node's own op would name another (F.one_hot's scatter)
USER_OP = "user_op"
# pipeline parallelism (passes/pipeline_parallel.py): the schedule's action a node belongs to, ("F"|"B"|"W", stage,
# micro-batch), and on the rank's last transfer the schedule itself (what a plan simulates with the nodes' costs)
PP_ACTION = "pp_action"
PP_SCHEDULE = "pp_schedule"


def phase(node: fx.Node) -> str:
    """``"backward"`` for nodes autograd recorded, else ``"forward"`` (optimizer and epilogue included)."""
    return node.meta.get("custom", {}).get("phase", "forward")


def fake_mode_of(gm: fx.GraphModule):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])


def refake(node: fx.Node, fake_mode) -> None:
    """Recompute ``node.meta["val"]`` from its inputs' (possibly changed) values."""
    args = fx.map_arg(node.args, lambda n: n.meta["val"])
    kwargs = fx.map_arg(node.kwargs, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
