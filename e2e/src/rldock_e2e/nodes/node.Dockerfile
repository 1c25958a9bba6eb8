# A kind-style Kubernetes node for the e2e (test tooling, not a product image): Debian bookworm
# with containerd, runc and the CNI plugins from Debian, the kubelet built from the control
# plane's own source (build_kubelet.sh), and the emulated Ascend device plugin. Run privileged,
# one container per node (nodes/cluster.py); node-entrypoint.sh starts everything.
# Build context: a folder nodes/cluster.py fills (these files, kubelet, api.proto).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

# bookworm's current versions (unpinned: test tooling, rebuilt when its inputs change).
# protobuf-compiler only generates the device-plugin messages below; python3-grpcio and
# python3-protobuf run the plugin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends containerd runc containernetworking-plugins \
        iptables iproute2 procps kmod python3-grpcio python3-protobuf protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*

COPY kubelet /usr/local/bin/kubelet
COPY api.proto device_plugin.py /opt/rldock-node/
# The kubelet's device-plugin API v1beta1, without the gogo-protobuf options (Go-only).
RUN sed -i -e '/gogo.proto/d' -e '/(gogoproto\./d' /opt/rldock-node/api.proto \
    && protoc --proto_path=/opt/rldock-node --python_out=/opt/rldock-node /opt/rldock-node/api.proto
COPY containerd.toml /etc/containerd/config.toml
COPY node-entrypoint.sh /usr/local/bin/node-entrypoint
ENTRYPOINT ["/usr/local/bin/node-entrypoint"]
