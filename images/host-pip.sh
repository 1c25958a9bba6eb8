# Sourced by images/build.sh: carry the host's pip configuration into image builds, read-only.
# Some machines reach PyPI only through a TLS-intercepting proxy (their CA bundle is needed) and
# take some wheels (the CPU torch) from local folders or file:// indexes; none of that may end up
# in an image. The host CA goes to its own path, never over the image's bundle (that would break
# Debian's ca-certificates package).

HOST_CA_IN_BUILD=/run/rldock-host/ca.crt

# The effective value of one pip setting: PIP_<KEY> first (pip's order), then the config files.
_host_pip_value() {
  local key=$1 env_name value
  env_name="PIP_$(tr 'a-z-' 'A-Z_' <<<"$key")"
  if [[ -n ${!env_name:-} ]]; then echo "${!env_name}"; return; fi
  value=$(python3 -m pip config list 2>/dev/null | sed -nE "s/^global\.$key='(.*)'$/\1/p" | tail -n1) || true
  echo "$value"
}

# host_pip_volumes CONF: write a pip.conf at CONF and set HOST_PIP_VOLUMES to the build's --volume
# arguments (empty when the host configures nothing that the build could use).
host_pip_volumes() {
  local conf=$1 cert links index extra item path kept=()
  HOST_PIP_VOLUMES=()
  cert=$(_host_pip_value cert)
  links=$(_host_pip_value find-links)
  index=$(_host_pip_value index-url)
  extra=$(_host_pip_value extra-index-url)
  local lines=()
  if [[ -n $cert && -f $cert ]]; then
    HOST_PIP_VOLUMES+=(--volume "$(readlink -f "$cert"):$HOST_CA_IN_BUILD:ro")
    lines+=("cert = $HOST_CA_IN_BUILD")
  fi
  for item in $links $extra; do  # local folders and file:// indexes are mounted at their own path
    path=${item#file://}
    if [[ $path == /* && -d $path ]]; then
      # A PEP 503 index links its files relatively (../../files/...): mount the folder above simple/.
      [[ $(basename "$path") != simple ]] || path=$(dirname "$path")
      HOST_PIP_VOLUMES+=(--volume "$path:$path:ro")
      kept+=("$item")
    elif [[ $item == http* ]]; then
      kept+=("$item")
    fi
  done
  local kept_links=() kept_extra=()
  for item in "${kept[@]}"; do
    if [[ " $links " == *" $item "* ]]; then kept_links+=("$item"); else kept_extra+=("$item"); fi
  done
  [[ ${#kept_links[@]} -eq 0 ]] || lines+=("find-links = ${kept_links[*]}")
  [[ ${#kept_extra[@]} -eq 0 ]] || lines+=("extra-index-url = ${kept_extra[*]}")
  [[ -z $index ]] || lines+=("index-url = $index")
  if [[ ${#lines[@]} -eq 0 ]]; then return 0; fi
  printf '[global]\n' >"$conf"
  printf '%s\n' "${lines[@]}" >>"$conf"
  # pip reads /etc/pip.conf in every environment, venvs included.
  HOST_PIP_VOLUMES+=(--volume "$conf:/etc/pip.conf:ro")
}
