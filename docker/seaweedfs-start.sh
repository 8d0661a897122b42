#!/bin/sh
# SeaweedFS as the CLM stack's S3-compatible object store (docker-compose.s3.yml): `weed mini`
# (master, volume server, filer and S3 gateway in one process) with one identity, the key pair
# the CLM services use (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), and the bucket made at start.
#
# Why SeaweedFS: it honours S3's conditional writes (create-only `If-None-Match: *`,
# compare-and-swap `If-Match`, on PUT and on multipart completion), which publishing
# versions and moving `latest` rely on (../shared/notes: what other servers get wrong).
#
# Environment:
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY  required: the only identity (no anonymous access)
#   CLM_S3_PORT                  S3 port (default 8333), the only port meant for other containers
#   CLM_S3_BUCKET                bucket(s) made at start when missing, comma-separated (default clm)
#   CLM_S3_DATA_DIR              where the data lives (default /data: the image's volume)
#   CLM_S3_VOLUME_SIZE_LIMIT_MB  size of one SeaweedFS volume file (default 256; each bucket grows its own)
# Arguments are passed on to `weed mini` (e.g. -s3.cacheCapacityMB=256, or other ports).
#
# The identities file holds the secret key: it is written anew at every start from the
# environment (so a changed key takes effect on restart), readable by this user only, and
# kept outside the data volume.
set -eu

fail() {
  echo "seaweedfs-start: $*" >&2
  exit 64
}

# A key goes verbatim into a JSON string: only characters that need no escaping are accepted
# (AWS-style keys: letters, digits and + / = . _ ~ -), never a quote, a backslash or a space.
check_key() {
  name=$1 value=$2
  [ -n "$value" ] || fail "$name is empty or unset: set the S3 key pair (compose: CLM_S3_ACCESS_KEY / CLM_S3_SECRET_KEY in .env)"
  case $value in
    *[!A-Za-z0-9+/=._~-]*) fail "$name contains a character other than letters, digits and + / = . _ ~ -" ;;
  esac
}

check_key AWS_ACCESS_KEY_ID "${AWS_ACCESS_KEY_ID:-}"
check_key AWS_SECRET_ACCESS_KEY "${AWS_SECRET_ACCESS_KEY:-}"

data=${CLM_S3_DATA_DIR:-/data}
port=${CLM_S3_PORT:-8333}
bucket=${CLM_S3_BUCKET:-clm}
volume_mb=${CLM_S3_VOLUME_SIZE_LIMIT_MB:-256}
case $port in '' | *[!0-9]*) fail "CLM_S3_PORT=$port is not a port number" ;; esac
case $volume_mb in '' | *[!0-9]*) fail "CLM_S3_VOLUME_SIZE_LIMIT_MB=$volume_mb is not a number" ;; esac
case $bucket in '' | *[!a-z0-9.,-]*) fail "CLM_S3_BUCKET=$bucket: bucket names are lower-case letters, digits, . and -" ;; esac
mkdir -p "$data/weed" || fail "cannot create $data/weed (is the volume writable by uid $(id -u)?)"

umask 077
config=$(mktemp "${TMPDIR:-/tmp}/seaweedfs-s3.XXXXXX")
cat > "$config" <<JSON
{"identities": [{"name": "clm", "credentials": [{"accessKey": "$AWS_ACCESS_KEY_ID", "secretKey": "$AWS_SECRET_ACCESS_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON

# -ip: the address the parts give each other (all in this process); -ip.bind: listen on every
# interface, so the S3 port answers other containers. No web UIs, no WebDAV, no Iceberg or Lance
# endpoints, no anonymous telemetry to seaweedfs.com.
exec weed mini -dir="$data/weed" -ip=127.0.0.1 -ip.bind=0.0.0.0 -webdav=false -admin.ui=false \
  -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false \
  -s3.port="$port" -s3.config="$config" -bucket="$bucket" -master.volumeSizeLimitMB="$volume_mb" "$@"
