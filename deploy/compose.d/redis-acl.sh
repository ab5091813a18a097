# shellcheck shell=sh
# deploy/compose.d/redis-acl.sh, sourced by deploy/lib.sh (wl_redis_acl, for deploy/local) and by
# the compose secrets step beside it: wl_redis_acl_lines PREFIX APP_PASSWORD ADMIN_PASSWORD prints
# the Redis ACL: no default user, `admin` for operators, and the replicas' `walletlock`: the lease
# keys and channels under PREFIX, FCALL but no script of its own, and the commands the lease layer
# sends (docs/operating/redis-access.md). Each password as an ACL rule: `>plain` or `#sha256-hex`.
wl_redis_acl_lines() {
  echo "user default off"
  echo "user admin on $3 ~* &* +@all"
  echo "user walletlock on $2 ~{$1:* &{$1:* +ping +hello +auth +client|setname +unwatch +fcall +function|list +get +set +del +exists +incr +pexpire +pttl +publish +subscribe +unsubscribe +cluster|slots +cluster|shards +cluster|nodes +cluster|myid +readonly +readwrite +role"
}
