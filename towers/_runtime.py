"""The non-public parts of TensorFlow towers uses, in one place.

Eight jobs have no public call: starting the collective runtime in this process
(``start``), aborting its pending collectives when a peer is lost
(``abort_collectives``, as MultiWorkerMirroredStrategy's health check does),
reading the graphs TensorFlow actually placed on devices (``placed_graphs``,
for ``towers explain``), finding the traced graph of a function a step calls
(``called_graph``: a tower traced once is a call, whose ops the placed graphs
name ``tower_1/StatefulPartitionedCall/...``), and asking whether op
determinism is on (``op_determinism``, for ``jit_compile="auto"``), and
keeping the functions a traced graph calls with a graph imported from it
(``functions_of``, ``add_functions``: a tower's pass is traced alone and cut
into phases, ``towers/step/run/cut.py``; a layer's own ``tf.function`` called in
it, its forward and backward among them, is dropped from the runtime when the
traced graph is collected, unless the phases hold it), and tracing a pass
into a graph of its own that never runs (``pass_graph``, for the cut). And one
attribute of a function the runtime reads with no public name: ``_noinline``
(``NO_INLINE``), which keeps a tower's traced pass a call of its own instead
of inlining it into the step's graph (``Towers(tower_functions="call")``).
And functions instantiated without Grappler (``unoptimised_calls``: the
eager context's call options, per thread: the check's float64 twin). And a
loop's carried value whose structure its body's trace decides
(``lazy_optional``, ``fix_spec``: the ``steps_per_execution`` loop of any
step, towers' or a model's own, ``towers/training/executions.py``).

Starting TensorFlow's collective runtime:

TensorFlow has no public call that turns on cross-process collectives without also
building a ``MultiWorkerMirroredStrategy`` (whose Keras 3 support is what towers
replaces). The strategy does it with three calls on the eager context, and so does
this module, the only place towers touches ``tensorflow.python``:

1. ``configure_collective_ops``: name the group leader (worker 0), which resolves
   which devices join each collective group;
2. ``enable_collective_ops(server_def)``: start this process's gRPC server on its
   ``TF_CONFIG`` address and register the cluster;
3. ``ensure_initialized``: make the devices (named ``/job:worker/task:i/...``).

All three must run before TensorFlow initialises (before the first op or device
listing); ``start`` says so if it is too late.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

JOB = "worker"
# A tf.function's attribute that keeps its calls from being inlined.
NO_INLINE = {"_noinline": True}


def _context():
    """The eager context, or a clear error if this TensorFlow lacks what we need."""
    try:
        from tensorflow.core.protobuf import tensorflow_server_pb2
        from tensorflow.python.eager import context
    except ImportError as error:  # pragma: no cover - depends on the installed TF
        raise RuntimeError(
            _unsupported(f"cannot import its eager context ({error})")
        ) from None
    ctx = context.context()
    for name in ("configure_collective_ops", "enable_collective_ops"):
        if not hasattr(ctx, name):
            raise RuntimeError(_unsupported(f"its eager context has no {name}()"))
    return ctx, tensorflow_server_pb2


def _unsupported(why: str) -> str:
    return (
        f"towers cannot start TensorFlow's collective runtime with TensorFlow "
        f"{tf.__version__}: {why}. Multi-worker towers is tested with TensorFlow "
        "2.21; install a TensorFlow 2.x that ships MultiWorkerMirroredStrategy's "
        "runtime."
    )


def initialized() -> bool:
    """Whether TensorFlow has initialised its devices in this process."""
    ctx, _ = _context()
    return ctx._context_handle is not None


def start(addresses: Sequence[str], index: int) -> None:
    """Joins this process to the cluster as worker ``index`` of ``addresses``.

    Raises:
      RuntimeError: TensorFlow already initialised, or its gRPC server could not
        start (the message names the address).
    """
    ctx, server_pb2 = _context()
    if initialized():
        raise RuntimeError(
            "the cluster must start before TensorFlow initialises; received a "
            "process where TensorFlow already ran ops or listed devices. Create "
            "towers.Towers (or call towers.Cluster.from_tf_config().start()) before "
            "building models or creating tensors; towers.virtual_devices() may come "
            "first."
        )
    leader = f"/job:{JOB}/replica:0/task:0"
    local = f"/job:{JOB}/task:{index}"
    # Only this worker's devices are visible here; peers are reached by collectives.
    ctx.configure_collective_ops(
        collective_leader=leader,
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(local,),
    )
    # The context's own config carries the logical device split (virtual_devices).
    config = ctx.config
    config.experimental.collective_group_leader = leader
    config.device_filters.append(local)
    server_def = server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec({JOB: list(addresses)}).as_cluster_def(),
        default_session_config=config,
        job_name=JOB,
        task_index=index,
        protocol="grpc",
    )
    ctx.enable_collective_ops(server_def)
    try:
        ctx.ensure_initialized()
    except tf.errors.OpError as error:
        raise RuntimeError(
            f"worker {index} could not start its gRPC server on {addresses[index]} "
            f"(its TF_CONFIG address): {error.message}. Is the port in use by "
            "another process?"
        ) from None


def abort_collectives(message: str) -> None:
    """Ends this process's pending collectives with ``message`` (an
    ``UnavailableError`` saying "Collective ops is aborted by: ..."), as
    MultiWorkerMirroredStrategy's health check ends them when a peer is lost.
    Each collective is aborted from its own thread and reports once; a
    collective's own ``timeout_seconds`` instead reports from a timer while
    its ring may still run, and in TensorFlow 2.21 that crashes the process
    now and then (SIGSEGV; issue 35). Later collectives fail too: the job must
    restart."""
    ctx, _ = _context()
    ctx.abort_collective_ops(tf.errors.UNAVAILABLE, message)


@contextlib.contextmanager
def placed_graphs() -> Iterator[list]:
    """Collects the graphs TensorFlow places and partitions while inside.

    Yields a list that is filled on exit with one entry per function instantiated
    inside: the list of its ``GraphDef`` partitions, one per device, as the
    placer and Grappler left them, each node on the device it ran on, with
    ``_Send``/``_Recv`` pairs where a tensor crosses devices. A function already
    instantiated before is not seen again, so trace a fresh one inside.

    Raises:
      RuntimeError: this TensorFlow's eager context cannot collect run metadata.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    needed = ("enable_run_metadata", "export_run_metadata", "disable_graph_collection")
    for name in needed:
        if not hasattr(ctx, name):  # pragma: no cover - depends on the installed TF
            raise RuntimeError(
                f"towers explain cannot read placed graphs with TensorFlow "
                f"{tf.__version__}: its eager context has no {name}()"
            )
    functions: list = []
    # Drop what earlier collection left (a profiler's, say): only the functions
    # instantiated inside count.
    ctx.export_run_metadata()
    ctx.enable_run_metadata()
    try:
        yield functions
    finally:
        metadata = ctx.export_run_metadata()
        ctx.disable_run_metadata()
        # Enabling run metadata also turns on graph collection, and disabling it
        # does not turn that off (TensorFlow 2.21): without this, every function
        # the process instantiates later would keep its graphs in memory.
        ctx.disable_graph_collection()
        if metadata is not None:
            for function in metadata.function_graphs:
                functions.append(list(function.partition_graphs))


def called_graph(graph: tf.Graph, name: str) -> tf.Graph | None:
    """The traced graph of the function that op ``name`` of ``graph`` calls, or
    None if there is no such op or it calls no function."""
    try:
        op = graph.get_operation_by_name(name)
        function = graph._get_function(op.get_attr("f").name)
    except (KeyError, ValueError):
        return None
    return getattr(function, "graph", None)


def op_determinism() -> bool:
    """Whether ``tf.config.experimental.enable_op_determinism`` is on (Keras'
    ``jit_compile="auto"`` then turns XLA off; TensorFlow has no public query)."""
    from tensorflow.python.framework import config

    return config.is_op_determinism_enabled()


def functions_of(graph: tf.Graph) -> list:
    """The functions ``graph`` holds for its ops to call (a layer's own
    ``tf.function``, and its forward and backward for a gradient)."""
    return list(graph._functions.values())


def add_functions(functions: list) -> None:
    """Adds ``functions`` (and the ones they call) to the graph being built,
    in place of any of the same name (``import_graph_def`` adds a copy of
    each from a graph's library, which holds no reference to the runtime's
    function): the graph, and a function made of it, then hold them for as
    long as they live."""
    graph = tf.compat.v1.get_default_graph()
    for function in functions:
        graph._add_function_recursive(function, overwrite=True)


@contextlib.contextmanager
def pass_graph(name: str, xla: bool) -> Iterator[tf.Graph]:
    """An empty graph to trace a tower's pass into, alone, as the default
    graph within (``towers/step/run/cut.py`` cuts it into phases): no control
    dependencies among its own ops, but its conditionals and loops (an
    assert's guard, a recurrent layer's loop) traced as a ``tf.function``
    traces them: each branch runs what it does (the assert) whatever reads
    it, and with ``xla`` their gradients are made for XLA to compile (a
    loop's kept values in lists of a known length, as
    ``tf.function(jit_compile=True)`` traces them). The cut keeps the pass's
    own such ops (``schedule.Schedule._effects``)."""
    from tensorflow.python.framework import func_graph
    from tensorflow.python.ops import control_flow_ops

    graph = func_graph.FuncGraph(name)
    graph._add_control_dependencies = True  # read by cond_v2 and while_v2 only
    with graph.as_default():
        context = control_flow_ops.XLAControlFlowContext() if xla else None
        if context is not None:
            context.Enter()
        try:
            yield graph
        finally:
            if context is not None:
                context.Exit()


def lazy_optional() -> tf.experimental.Optional:
    """An empty ``tf.experimental.Optional`` to carry through a
    ``tf.while_loop`` what its body returns, whose structure is known only
    once the body is traced; :func:`fix_spec` gives it that structure then
    (``_element_spec``, as Keras' own loop of ``steps_per_execution`` steps
    does: ``keras/src/backend/tensorflow/trainer.py``)."""
    return tf.experimental.Optional.empty(None)


def fix_spec(empty: tf.experimental.Optional, like: tf.experimental.Optional) -> None:
    """Gives ``empty`` (:func:`lazy_optional`) the element spec of ``like``."""
    empty._element_spec = like.element_spec


def xla_body(function: Any) -> Any:
    """The Python function of a ``tf.function(jit_compile=True)`` (its
    ``_jit_compile``, with no public name), or None for any other: a model's
    own step decorated so is traced in each tower's step, where one XLA
    computation could not read variables on the variable device."""
    if isinstance(function, tf.types.experimental.PolymorphicFunction):
        if getattr(function, "_jit_compile", None):
            return function.python_function
    return None


@contextlib.contextmanager
def unoptimised_calls() -> Iterator[None]:
    """Functions first called inside, in this thread, are instantiated
    without Grappler (the eager context's per-thread call options, which
    have no public setter): a graph run once (the check's float64 twin,
    ``towers/training/twin.py``) pays less to build than Grappler would
    save. A function instantiated before keeps its optimised graph."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    kept = ctx.function_call_options
    config = config_pb2.ConfigProto.FromString(kept.config_proto_serialized)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=kept.executor_type, config_proto=config
    )
    try:
        yield
    finally:
        ctx.function_call_options = kept
