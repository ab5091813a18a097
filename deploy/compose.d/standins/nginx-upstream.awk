# compose's upstream.conf for nginx < 1.27.3 (no `resolve`; deploy/lib.sh, nginx-follow-dns.sh):
# no resolver, and the `server NAME:PORT ... resolve` line once per address of `servers` (space-
# separated; one without a port takes NAME's), with max_conns=`max_conns` if that is set.
/^[[:space:]]*resolver[[:space:]]/ { next }
$1 == "server" && / resolve[ ;]/ {
  sub(/ resolve/, "")
  if (max_conns != "") sub(/max_conns=[0-9]+/, "max_conns=" max_conns)
  port = $2
  sub(/^.*:/, "", port)
  n = split(servers, server, " ")
  for (i = 1; i <= n; i++) {
    line = $0
    sub(/server [^ ;]+/, "server " server[i] (server[i] ~ /:/ ? "" : ":" port), line)
    print line
  }
  next
}
{ print }
