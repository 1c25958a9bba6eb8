"""Emulated Ascend device plugin (a test double of Huawei's ascend-device-plugin) for the e2e's
kind-style nodes: speaks the kubelet's device-plugin API v1beta1 (gRPC over the kubelet's unix
sockets), advertises N healthy `huawei.com/Ascend910` devices and, in Allocate, sets the variables
the real plugin sets, so pods are scheduled and see their devices as on an Ascend node. There are
no device files: the runtime computes on the CPU.

Runs inside a node container with Debian's python3-grpcio; `api_pb2` is generated from the
kubelet's api.proto when the node image is built (node.Dockerfile). The gRPC service is
registered by hand (generic handlers) so no grpc code generator is needed.

    python3 device_plugin.py --resource huawei.com/Ascend910 --devices 8
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import api_pb2  # generated in the node image
import grpc

log = logging.getLogger("device-plugin")

API_VERSION = "v1beta1"
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = PLUGIN_DIR / "kubelet.sock"
# What Huawei's plugin hands a container: the devices for the Ascend container runtime
# (ASCEND_VISIBLE_DEVICES, physical ids) and for CANN's runtime inside (ASCEND_RT_VISIBLE_DEVICES).
VISIBLE_DEVICES_ENVS = ("ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
# Kubelet restarts wipe the plugin folder; a plugin must then register again. How often we look.
SOCKET_CHECK_SECONDS = 1.0


def device_ids(resource: str, count: int) -> list[str]:
    """Device ids as Huawei's plugin names them: `Ascend910-0`, `Ascend910-1`, ..."""
    chip = resource.rsplit("/", 1)[-1]
    return [f"{chip}-{index}" for index in range(count)]


def allocation_envs(ids: list[str]) -> dict[str, str]:
    """The environment of a container given `ids` (physical indexes, sorted, comma-separated)."""
    indexes = ",".join(str(i) for i in sorted(int(d.rsplit("-", 1)[1]) for d in ids))
    return {name: indexes for name in VISIBLE_DEVICES_ENVS}


class EmulatedAscendPlugin:
    """The DevicePlugin service: every device healthy, allocation only sets the environment."""

    def __init__(self, resource: str, count: int) -> None:
        self.resource = resource
        self.ids = device_ids(resource, count)
        self.stopped = threading.Event()

    def get_options(self, request, context):
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    def list_and_watch(self, request, context):
        devices = [api_pb2.Device(ID=i, health="Healthy") for i in self.ids]
        yield api_pb2.ListAndWatchResponse(devices=devices)
        # The stream stays open (the kubelet treats its end as the plugin going away); the
        # device set never changes.
        while not self.stopped.wait(timeout=60) and context.is_active():
            pass

    def allocate(self, request, context):
        responses = []
        for container in request.container_requests:
            envs = allocation_envs(list(container.devicesIDs))
            log.info("allocate %s -> %s", list(container.devicesIDs), envs)
            responses.append(api_pb2.ContainerAllocateResponse(envs=envs))
        return api_pb2.AllocateResponse(container_responses=responses)

    def pre_start(self, request, context):
        return api_pb2.PreStartContainerResponse()

    def preferred(self, request, context):
        return api_pb2.PreferredAllocationResponse()

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(method, request_type, response_type):
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            f"{API_VERSION}.DevicePlugin",
            {
                "GetDevicePluginOptions": unary(self.get_options, api_pb2.Empty, api_pb2.DevicePluginOptions),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self.list_and_watch,
                    request_deserializer=api_pb2.Empty.FromString,
                    response_serializer=api_pb2.ListAndWatchResponse.SerializeToString,
                ),
                "Allocate": unary(self.allocate, api_pb2.AllocateRequest, api_pb2.AllocateResponse),
                "PreStartContainer": unary(
                    self.pre_start, api_pb2.PreStartContainerRequest, api_pb2.PreStartContainerResponse
                ),
                "GetPreferredAllocation": unary(
                    self.preferred, api_pb2.PreferredAllocationRequest, api_pb2.PreferredAllocationResponse
                ),
            },
        )


def register(socket_name: str, resource: str) -> None:
    """Tell the kubelet where the plugin listens (the kubelet then calls ListAndWatch)."""
    with grpc.insecure_channel(f"unix://{KUBELET_SOCKET}") as channel:
        call = channel.unary_unary(
            f"/{API_VERSION}.Registration/Register",
            request_serializer=api_pb2.RegisterRequest.SerializeToString,
            response_deserializer=api_pb2.Empty.FromString,
        )
        call(
            api_pb2.RegisterRequest(
                version=API_VERSION, endpoint=socket_name, resource_name=resource, options=api_pb2.DevicePluginOptions()
            ),
            timeout=10,
        )


def serve(resource: str, count: int) -> None:
    socket_name = f"rldock-{resource.replace('/', '-').replace('.', '-')}.sock"
    socket_path = PLUGIN_DIR / socket_name
    while True:
        while not KUBELET_SOCKET.exists():
            time.sleep(SOCKET_CHECK_SECONDS)
        plugin = EmulatedAscendPlugin(resource, count)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((plugin.handler(),))
        if socket_path.exists():
            socket_path.unlink()
        server.add_insecure_port(f"unix://{socket_path}")
        server.start()
        register(socket_name, resource)
        log.info("registered %s x%d at %s", resource, count, socket_path)
        # A restarted kubelet removes every socket in the folder: start over and register again.
        while socket_path.exists():
            time.sleep(SOCKET_CHECK_SECONDS)
        log.info("%s removed (kubelet restarted?): registering again", socket_path)
        plugin.stopped.set()
        server.stop(grace=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resource", default="huawei.com/Ascend910")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.makedirs(PLUGIN_DIR, exist_ok=True)
    serve(args.resource, args.devices)


if __name__ == "__main__":
    main()
