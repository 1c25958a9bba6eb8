#!/bin/bash
# PID 1 of a kind-style node container (node.Dockerfile): cgroup root, pod network, containerd,
# the images, the emulated Ascend device plugin, then the kubelet in the foreground. Stopping the
# container ends its PID namespace, and with it every pod process (they live in nested ones).
#
# Environment (nodes/cluster.py sets it): NODE_NAME, POD_CIDR, ROUTES ("cidr via ip,..." to the
# other nodes' pod ranges), CLUSTER_DNS, DEVICE_RESOURCE, DEVICES (how many to advertise),
# API_SERVICE ("<ClusterIP of Service kubernetes> <API server ip>:<port>");
# mounts: /etc/rldock-node/kubeconfig (read-only), /images/*.tar (OCI archives to load).
set -euo pipefail
log() { echo "[node $NODE_NAME] $*" >&2; }
NODE_IP=$(ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)

# The kubelet's cgroup root must exist in every hierarchy; one per node, as the nodes share the
# host's cgroup tree (cgroup v1 with the cgroupfs driver).
CGROUP_ROOT="/rldock-node-$NODE_NAME"
for hierarchy in /sys/fs/cgroup/*/; do
    [[ -e $hierarchy/cgroup.procs ]] && mkdir -p "$hierarchy$CGROUP_ROOT"
done
[[ -e /sys/fs/cgroup/cgroup.procs ]] && mkdir -p "/sys/fs/cgroup$CGROUP_ROOT"

# Pod network: a bridge per node over its own range, routes to the other nodes' ranges.
mkdir -p /etc/cni/net.d
cat >/etc/cni/net.d/10-rldock.conflist <<CNI
{"cniVersion": "0.4.0", "name": "rldock", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI
IFS=, read -ra routes <<<"${ROUTES:-}"
for route in "${routes[@]}"; do
    [[ -z $route ]] || ip route replace ${route% via *} via ${route#* via }
done

# kube-proxy's one rule that in-cluster clients need: Service `kubernetes` to the API server.
if [[ -n ${API_SERVICE:-} ]]; then
    iptables -t nat -A PREROUTING -d "${API_SERVICE% *}" -p tcp --dport 443 -j DNAT --to-destination "${API_SERVICE#* }"
    iptables -t nat -A OUTPUT -d "${API_SERVICE% *}" -p tcp --dport 443 -j DNAT --to-destination "${API_SERVICE#* }"
fi

containerd --config /etc/containerd/config.toml >/var/log/containerd.log 2>&1 &
for _ in $(seq 100); do [[ -S /run/containerd/containerd.sock ]] && break; sleep 0.1; done
ctr version >/dev/null
for archive in /images/*.tar; do
    [[ -e $archive ]] || continue
    log "loading $archive"
    # Unpacked now: unpacking a multi-GB image at container creation outlasts the kubelet's
    # runtime request timeout on a loaded machine (CreateContainerError: context deadline exceeded).
    ctr -n k8s.io images import "$archive" >/dev/null
done

mkdir -p /var/lib/kubelet/device-plugins
python3 /opt/rldock-node/device_plugin.py --resource "$DEVICE_RESOURCE" --devices "$DEVICES" \
    >/var/log/device-plugin.log 2>&1 &

cat >/var/lib/kubelet/config.yaml <<KUBELET
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# The API server reaches the kubelet (logs, exec) without a client certificate in this test cluster.
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: $CGROUP_ROOT
failSwapOn: false
# Writing a negative oom_score_adj is refused on some machines (see containerd.toml).
oomScoreAdj: 0
clusterDNS: [${CLUSTER_DNS}]
clusterDomain: cluster.local
podCIDR: $POD_CIDR
resolvConf: /etc/resolv.conf
# Disk and memory are shared with the host: only evict when truly short.
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}
imageGCHighThresholdPercent: 100
serializeImagePulls: false
# Creating a container from a multi-GB image takes minutes on a loaded 2-core machine.
runtimeRequestTimeout: 10m
KUBELET
log "kubelet on $NODE_IP, pods in $POD_CIDR"
exec kubelet --config=/var/lib/kubelet/config.yaml --kubeconfig=/etc/rldock-node/kubeconfig \
    --container-runtime=remote --container-runtime-endpoint=unix:///run/containerd/containerd.sock \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --pod-infra-container-image=localhost/rldock/pause:1.20.2 \
    --v=1
