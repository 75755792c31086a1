#!/usr/bin/python3
"""A small Python client of himoe's RouterService (grpcio + numpy).

Generates the Python stubs from proto/ at run time (grpc_tools.protoc), then
sends a [T, d_model] float32 array through one MoE layer of a running router.

Run it with the system interpreter (Debian packages python3-grpcio,
python3-grpc-tools, python3-protobuf, python3-numpy):

  /usr/bin/python3 tests/router_service/python_client.py \
      --proto_dir proto --out_dir /tmp/himoe_gen --router 127.0.0.1:50050 \
      --input x.pb [--expected y.pb] --layer 1

--input/--expected are serialized himoe.v1.Tensor messages. Without --input a
random [--tokens, d_model] array is sent. With --expected the script is a
check (used by tests/router_service/python_client_test.cc): the output must be
within --tolerance of it, the routing must be [T, K] int64, Info must report
d_model, and a request with the wrong width must be INVALID_ARGUMENT naming
d_model. Exit 0 on success, 1 with a message otherwise.

As a library:

  stub = connect("127.0.0.1:50050", proto_dir, out_dir)
  y = route_forward(stub, layer=0, array=x)   # x: np.float32 [T, d_model]
"""

import argparse
import collections
import importlib
import os
import subprocess
import sys

try:
    import grpc
    import numpy as np
except ImportError as e:  # pragma: no cover - reported, not raised
    sys.stderr.write(
        "python_client.py: cannot import %s with %s; install the Debian packages "
        "python3-grpcio python3-grpc-tools python3-protobuf python3-numpy and run "
        "this with /usr/bin/python3\n" % (e.name, sys.executable))
    sys.exit(1)

# Every proto the project ships, as the README's stub command compiles them
# (cluster.proto is proto2 so that old protoc releases accept it).
PROTOS = ("himoe/v1/tensor.proto", "himoe/v1/model.proto", "himoe/v1/expert.proto",
          "himoe/v1/router.proto", "himoe/v1/cluster.proto", "grpc_health/v1/health.proto")

# Filled by load_stubs().
tensor_pb2 = None
router_pb2 = None
router_pb2_grpc = None
health_pb2 = None
health_pb2_grpc = None

RouteResult = collections.namedtuple("RouteResult", ["output", "expert_ids", "weights"])


class ClientError(Exception):
    pass


def generate_stubs(proto_dir, out_dir):
    """Runs grpc_tools.protoc (this interpreter) on the router protos into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I" + proto_dir,
           "--python_out=" + out_dir, "--grpc_python_out=" + out_dir]
    cmd += [os.path.join(proto_dir, p) for p in PROTOS]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, timeout=120)
    if result.returncode != 0:
        raise ClientError("grpc_tools.protoc failed (%d): %s\n%s" %
                          (result.returncode, " ".join(cmd), result.stdout))


def load_stubs(out_dir):
    """Imports the generated modules. grpc_tools writes himoe/v1/<name>_pb2.py and
    <name>_pb2_grpc.py (no __init__.py: namespace packages); newer versions may
    emit the gRPC classes elsewhere, so both layouts are looked up."""
    global tensor_pb2, router_pb2, router_pb2_grpc, health_pb2, health_pb2_grpc
    out_dir = os.path.abspath(out_dir)
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    importlib.invalidate_caches()
    tensor_pb2 = importlib.import_module("himoe.v1.tensor_pb2")
    router_pb2 = importlib.import_module("himoe.v1.router_pb2")
    try:
        router_pb2_grpc = importlib.import_module("himoe.v1.router_pb2_grpc")
    except ImportError:
        router_pb2_grpc = router_pb2  # very old plugins put the stub in _pb2
    health_pb2 = importlib.import_module("grpc_health.v1.health_pb2")
    health_pb2_grpc = importlib.import_module("grpc_health.v1.health_pb2_grpc")
    if not hasattr(router_pb2_grpc, "RouterServiceStub"):
        raise ClientError("generated code has no RouterServiceStub (looked in %s)" %
                          router_pb2_grpc.__file__)


def connect(address, proto_dir, out_dir):
    """Generates and loads the stubs, returns a RouterServiceStub for address."""
    generate_stubs(proto_dir, out_dir)
    load_stubs(out_dir)
    channel = grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20)])
    return router_pb2_grpc.RouterServiceStub(channel)


# --- himoe.v1.Tensor <-> numpy (little-endian, row-major) ---------------------

def _numpy_dtypes():
    return {
        tensor_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
        tensor_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
        tensor_pb2.DTYPE_INT64: np.dtype("<i8"),
        tensor_pb2.DTYPE_INT32: np.dtype("<i4"),
    }


def tensor_to_numpy(t):
    """A copy of t as a native-endian numpy array (bfloat16 widens to float32)."""
    shape = tuple(t.shape)
    bf16 = t.dtype == tensor_pb2.DTYPE_BFLOAT16
    dtypes = _numpy_dtypes()
    if not bf16 and t.dtype not in dtypes:
        raise ClientError("unsupported tensor dtype %d" % t.dtype)
    dt = np.dtype("<u2") if bf16 else dtypes[t.dtype]
    expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(t.data) != expected:
        raise ClientError("tensor of shape %s has %d bytes, expected %d" %
                          (list(shape), len(t.data), expected))
    a = np.frombuffer(t.data, dtype=dt).reshape(shape)
    if bf16:  # bfloat16 is the top 16 bits of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(dt.newbyteorder("="))


def numpy_to_tensor(array):
    array = np.asarray(array)
    for code, dt in _numpy_dtypes().items():
        if array.dtype.kind == dt.kind and array.dtype.itemsize == dt.itemsize:
            data = np.ascontiguousarray(array, dtype=dt).tobytes()
            return tensor_pb2.Tensor(dtype=code, shape=list(array.shape), data=data)
    raise ClientError("unsupported numpy dtype %s" % array.dtype)


def read_tensor(path):
    t = tensor_pb2.Tensor()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return tensor_to_numpy(t)


# --- calls --------------------------------------------------------------------

def route_forward_full(stub, layer, array, return_routing=True, timeout=30.0):
    """One RouteForward; array is [T, d_model] float32. Returns RouteResult
    (expert_ids [T, K] int64 and weights [T, K] float32 when return_routing)."""
    request = router_pb2.RouteForwardRequest(
        layer=layer, hidden=numpy_to_tensor(np.asarray(array, dtype=np.float32)),
        return_routing=return_routing)
    response = stub.RouteForward(request, timeout=timeout)
    ids = weights = None
    if return_routing:
        ids = tensor_to_numpy(response.expert_ids)
        weights = tensor_to_numpy(response.weights)
    return RouteResult(tensor_to_numpy(response.output), ids, weights), response


def route_forward(stub, layer, array, timeout=30.0):
    """y = MoE layer `layer` of x: [T, d_model] float32 in, [T, d_model] float32 out."""
    result, _ = route_forward_full(stub, layer, array, return_routing=False,
                                   timeout=timeout)
    return result.output


def info(stub, timeout=30.0):
    return stub.Info(router_pb2.RouterInfoRequest(), timeout=timeout)


def health(address, service="", timeout=30.0):
    """grpc.health.v1 status name of `service` ("" = the server) at address."""
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# --- the check ----------------------------------------------------------------

def check(stub, args):
    for service in ("", "himoe.v1.RouterService"):
        status = health(args.router, service)
        if status != "SERVING":
            raise ClientError("health of '%s' is %s, expected SERVING" % (service, status))
    print("health: SERVING (server and himoe.v1.RouterService)")
    router_info = info(stub)
    d = router_info.d_model
    K = router_info.num_groups * router_info.top_k
    print("router: %s, method %s, N=%d M=%d k=%d d_model=%d, layers %s" %
          (router_info.version, router_info.method, router_info.num_experts,
           router_info.num_groups, router_info.top_k, d, list(router_info.layers)))
    if d <= 0:
        raise ClientError("Info.d_model is %d" % d)
    if args.input:
        x = read_tensor(args.input)
    else:
        x = np.random.default_rng(0).standard_normal((args.tokens, d)).astype(np.float32)
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != d:
        raise ClientError("input is %s %s; the router wants float32 [T, %d]" %
                          (x.dtype, list(x.shape), d))

    result, response = route_forward_full(stub, args.layer, x, return_routing=True)
    if response.output.dtype != tensor_pb2.DTYPE_FLOAT32:
        raise ClientError("output dtype is %s, expected DTYPE_FLOAT32" %
                          tensor_pb2.DType.Name(response.output.dtype))
    if result.output.shape != x.shape:
        raise ClientError("output shape %s, expected %s" %
                          (list(result.output.shape), list(x.shape)))
    if response.expert_ids.dtype != tensor_pb2.DTYPE_INT64 or \
            result.expert_ids.shape != (x.shape[0], K):
        raise ClientError("expert_ids is %s %s, expected DTYPE_INT64 [%d, %d]" %
                          (tensor_pb2.DType.Name(response.expert_ids.dtype),
                           list(result.expert_ids.shape), x.shape[0], K))
    if result.expert_ids.min() < 0 or result.expert_ids.max() >= router_info.num_experts:
        raise ClientError("expert_ids outside [0, %d)" % router_info.num_experts)
    if result.weights.shape != (x.shape[0], K):
        raise ClientError("weights shape %s, expected [%d, %d]" %
                          (list(result.weights.shape), x.shape[0], K))
    # The small route_forward helper gives the same answer.
    if not np.array_equal(route_forward(stub, args.layer, x), result.output):
        raise ClientError("route_forward() and route_forward_full() disagree")
    summary = "RouteForward layer %d: %d tokens -> %s float32, expert_ids [%d, %d] int64" % (
        args.layer, x.shape[0], list(result.output.shape), x.shape[0], K)
    if args.expected:
        y = read_tensor(args.expected)
        if y.shape != result.output.shape:
            raise ClientError("expected shape %s != output shape %s" %
                              (list(y.shape), list(result.output.shape)))
        err = float(np.max(np.abs(result.output.astype(np.float64) - y)))
        if not err <= args.tolerance:  # also catches NaN
            raise ClientError("max |out - expected| = %g > %g" % (err, args.tolerance))
        summary += ", max |out - expected| = %.3g (<= %g)" % (err, args.tolerance)
    print(summary)

    # A request with the wrong width must be rejected, naming d_model.
    bad = np.zeros((4, d + 1), dtype=np.float32)
    try:
        route_forward(stub, args.layer, bad)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "d_model" not in (e.details() or ""):
            raise ClientError("wrong d: got %s '%s', expected INVALID_ARGUMENT naming d_model" %
                              (e.code(), e.details()))
        print("wrong d rejected: %s: %s" % (e.code().name, e.details()))
    else:
        raise ClientError("a [4, %d] request was accepted by a d_model=%d router" % (d + 1, d))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--proto_dir", default=os.path.join(here, "..", "..", "proto"),
                        help="folder holding himoe/v1/*.proto")
    parser.add_argument("--out_dir", required=True, help="where the stubs are generated")
    parser.add_argument("--router", required=True, help="host:port of the RouterService")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--input", help="serialized himoe.v1.Tensor [T, d_model] float32")
    parser.add_argument("--tokens", type=int, default=16, help="T when --input is absent")
    parser.add_argument("--expected", help="serialized himoe.v1.Tensor: the expected output")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    try:
        try:
            stub = connect(args.router, args.proto_dir, args.out_dir)
        except TypeError as e:
            # Code from an old grpc_tools protoc (1.14 here) builds descriptors
            # directly, which the upb/cpp runtimes of protobuf >= 4.21 from pip
            # refuse; the pure-Python runtime still accepts it.
            env_var = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
            if "Descriptors cannot be created directly" in str(e) and \
                    os.environ.get(env_var) != "python":
                os.environ[env_var] = "python"
                os.execv(sys.executable, [sys.executable] + sys.argv)
            raise
        check(stub, args)
    except grpc.RpcError as e:
        print("FAIL: %s: %s" % (e.code(), e.details()), file=sys.stderr)
        return 1
    except (ClientError, OSError, subprocess.SubprocessError) as e:
        print("FAIL: %s" % e, file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
