#!/bin/busybox sh
# /init of the soft-RoCE guest: mounts, loads rdma_rxe, builds the devices the checks use,
# runs /rg/run and prints "RXE-EXIT <status>" before powering off.
#
# Devices (tests/rxe/README.md):
#   rxe0          on lo: GIDs fe80::200:ff:fe00:0, ::ffff:127.0.0.1, ::1; MTU 4096
#   rxe_va/rxe_vb on the two ends of the veth pair va (10.99.0.1, MTU 1500 -> RoCE MTU 1024)
#                 and vb (10.99.0.2, MTU 9000 -> 4096); policy routing sends their traffic
#                 over the pair, not through the local table
#   rxe_d0/rxe_d1 on two dummies of one MAC (one adapter to the plugin, two lanes), each with
#                 IPv6 fd00:98::N added before IPv4 10.98.0.N
#   rxe_d6        on a dummy with IPv6 fd00:96::1 and no IPv4
export PATH=/usr/bin:/bin:/usr/sbin:/sbin HOME=/root
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
chmod 1777 /tmp
up() { cut -d' ' -f1 /proc/uptime; }
# busybox runs its own applets before PATH: iproute2's ip is the one that knows veth and rules.
ip() { /usr/bin/ip "$@"; }
fail() {
  echo "GUEST: $*"
  echo "RXE-EXIT 125"
  reboot -f
}
echo "GUEST: /init at $(up) s, Linux $(uname -r)"
for m in crc32_generic rdma_rxe ib_uverbs veth dummy; do modprobe $m || fail "modprobe $m failed"; done

sysctl -qw net.ipv6.conf.default.accept_dad=0 net.ipv6.conf.all.accept_dad=0
# soft-RoCE sends bursts of up to 64 packets a queue pair; a veth hands each to the
# receiving CPU's backlog, which drops past 1000 packets by default, and rxe retransmits.
sysctl -qw net.core.netdev_max_backlog=65536
ip link set lo up
ip link add va mtu 1500 type veth peer name vb mtu 9000
ip addr add 10.99.0.1/24 dev va
ip addr add 10.99.0.2/24 dev vb
# Both ends are local addresses: without these rules the kernel would deliver between them
# through lo. Locally sent packets (iif lo) between the two take the pair; received ones
# reach the local table, which moves behind the rules.
ip rule add pref 10 iif lo from 10.99.0.1 to 10.99.0.2 lookup 101
ip rule add pref 10 iif lo from 10.99.0.2 to 10.99.0.1 lookup 102
ip rule add pref 100 lookup local
ip rule del pref 0
for c in all default va vb; do sysctl -qw net.ipv4.conf.$c.accept_local=1 net.ipv4.conf.$c.rp_filter=0; done
ip link set va up
ip link set vb up
ip route add 10.99.0.2 dev va src 10.99.0.1 table 101
ip route add 10.99.0.1 dev vb src 10.99.0.2 table 102
for d in 0 1; do
  ip link add d$d address 02:00:00:00:98:01 type dummy
  ip link set d$d up
  ip addr add fd00:98::$((d + 1))/64 dev d$d nodad
  ip addr add 10.98.0.$((d + 1))/24 dev d$d
done
ip link add d6 address 02:00:00:00:96:01 type dummy
ip link set d6 up
ip addr add fd00:96::1/64 dev d6 nodad

rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0 failed"
for n in va vb d0 d1 d6; do rdma link add rxe_$n type rxe netdev $n || fail "rdma link add rxe_$n failed"; done
export RG_RXE_GUEST=1 RXE_DEV=rxe0 RXE_PAIR=rxe_va/va/10.99.0.1,rxe_vb/vb/10.99.0.2 RXE_TWINS=rxe_d0,rxe_d1
echo "GUEST: devices ready at $(up) s"
rdma link show
ulimit -l unlimited
ulimit -n 65536
sh /rg/run
rc=$?
echo "GUEST: finished at $(up) s"
echo "RXE-EXIT $rc"
sync
reboot -f
