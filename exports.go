// Command roce_gather is the NCCL plugin library (built with -buildmode=c-shared): the
// versioned ncclNet, ncclCollNet and tuner tables NCCL looks up with dlsym. Every entry
// point lives in package plugin; this file only assembles the tables.
package main

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#cgo CFLAGS: -I${SRCDIR}/include
#include "plugin/abi.h"
#include "nccl/abi_check.h"

const ncclNet_v8_t ncclNetPlugin_v8 = {
  RG_NET_NAME, rg_net_init_v8, rg_net_devices, rg_net_get_properties_v8, rg_net_listen_noctx, rg_net_connect_v8,
  rg_net_accept, rg_net_reg_mr, rg_net_reg_mr_dmabuf, rg_net_dereg_mr, rg_net_isend_v8, rg_net_irecv_v8,
  rg_net_iflush, rg_net_test, rg_net_close_send, rg_net_close_recv, rg_net_close_listen, rg_net_get_device_mr,
  rg_net_irecv_consumed,
};

const ncclNet_v9_t ncclNetPlugin_v9 = {
  RG_NET_NAME, rg_net_init_v9, rg_net_devices, rg_net_get_properties_v9, rg_net_listen_noctx, rg_net_connect_v8,
  rg_net_accept, rg_net_reg_mr, rg_net_reg_mr_dmabuf, rg_net_dereg_mr, rg_net_isend_v9, rg_net_irecv_v9,
  rg_net_iflush, rg_net_test, rg_net_close_send, rg_net_close_recv, rg_net_close_listen, rg_net_get_device_mr,
  rg_net_irecv_consumed, rg_net_make_vdevice_v9,
};

const ncclNet_v10_t ncclNetPlugin_v10 = {
  RG_NET_NAME, rg_net_init_v10, rg_net_devices, rg_net_get_properties_v9, rg_net_listen_noctx, rg_net_connect_v10,
  rg_net_accept, rg_net_reg_mr, rg_net_reg_mr_dmabuf, rg_net_dereg_mr, rg_net_isend, rg_net_irecv,
  rg_net_iflush, rg_net_test, rg_net_close_send, rg_net_close_recv, rg_net_close_listen, rg_net_get_device_mr,
  rg_net_irecv_consumed, rg_net_make_vdevice_v9,
};

const ncclNet_v11_t ncclNetPlugin_v11 = {
  RG_NET_NAME, rg_net_init_v11, rg_net_devices, rg_net_get_properties_v11, rg_net_listen, rg_net_connect,
  rg_net_accept, rg_net_reg_mr, rg_net_reg_mr_dmabuf, rg_net_dereg_mr, rg_net_isend, rg_net_irecv,
  rg_net_iflush, rg_net_test, rg_net_close_send, rg_net_close_recv, rg_net_close_listen, rg_net_get_device_mr,
  rg_net_irecv_consumed, rg_net_make_vdevice_v9, rg_net_finalize, rg_net_set_net_attr,
};

const ncclNet_v12_t ncclNetPlugin_v12 = {
  RG_NET_NAME, rg_net_init_v12, rg_net_devices, rg_net_get_properties_v12, rg_net_listen, rg_net_connect,
  rg_net_accept, rg_net_reg_mr, rg_net_reg_mr_dmabuf, rg_net_dereg_mr, rg_net_isend, rg_net_irecv,
  rg_net_iflush, rg_net_test, rg_net_close_send, rg_net_close_recv, rg_net_close_listen, rg_net_get_device_mr,
  rg_net_irecv_consumed, rg_net_make_vdevice_v12, rg_net_finalize, rg_net_set_net_attr,
};

const ncclCollNet_v8_t ncclCollNetPlugin_v8 = {
  RG_NET_NAME, rg_coll_init_v8, rg_coll_devices, rg_coll_get_properties_v8, rg_coll_listen_noctx, rg_coll_connect,
  rg_coll_reduce_support, rg_coll_reg_mr, rg_coll_reg_mr_dmabuf, rg_coll_dereg_mr, rg_coll_iallreduce_v8,
  rg_coll_iallgather_v8, rg_coll_ireducescatter_v8, rg_coll_iflush, rg_coll_test, rg_coll_close_coll,
  rg_coll_close_listen,
};

const ncclCollNet_v9_t ncclCollNetPlugin_v9 = {
  RG_NET_NAME, rg_coll_init_v9, rg_coll_devices, rg_coll_get_properties_v9, rg_coll_listen_noctx, rg_coll_connect,
  rg_coll_reduce_support, rg_coll_reg_mr, rg_coll_reg_mr_dmabuf, rg_coll_dereg_mr, rg_coll_iallreduce,
  rg_coll_iallgather, rg_coll_ireducescatter, rg_coll_iflush, rg_coll_test, rg_coll_close_coll,
  rg_coll_close_listen, rg_coll_make_vdevice_v9,
};

const ncclCollNet_v10_t ncclCollNetPlugin_v10 = {
  RG_NET_NAME, rg_coll_init_v10, rg_coll_devices, rg_coll_get_properties_v9, rg_coll_listen_noctx, rg_coll_connect,
  rg_coll_reduce_support, rg_coll_reg_mr, rg_coll_reg_mr_dmabuf, rg_coll_dereg_mr, rg_coll_iallreduce,
  rg_coll_iallgather, rg_coll_ireducescatter, rg_coll_iflush, rg_coll_test, rg_coll_close_coll,
  rg_coll_close_listen, rg_coll_make_vdevice_v9,
};

const ncclCollNet_v11_t ncclCollNetPlugin_v11 = {
  RG_NET_NAME, rg_coll_init_v11, rg_coll_devices, rg_coll_get_properties_v11, rg_coll_listen, rg_coll_connect,
  rg_coll_reduce_support, rg_coll_reg_mr, rg_coll_reg_mr_dmabuf, rg_coll_dereg_mr, rg_coll_iallreduce,
  rg_coll_iallgather, rg_coll_ireducescatter, rg_coll_iflush, rg_coll_test, rg_coll_close_coll,
  rg_coll_close_listen, rg_coll_make_vdevice_v9, rg_coll_finalize,
};

const ncclCollNet_v12_t ncclCollNetPlugin_v12 = {
  RG_NET_NAME, rg_coll_init_v12, rg_coll_devices, rg_coll_get_properties_v12, rg_coll_listen, rg_coll_connect,
  rg_coll_reduce_support, rg_coll_reg_mr, rg_coll_reg_mr_dmabuf, rg_coll_dereg_mr, rg_coll_iallreduce,
  rg_coll_iallgather, rg_coll_ireducescatter, rg_coll_iflush, rg_coll_test, rg_coll_close_coll,
  rg_coll_close_listen, rg_coll_make_vdevice_v12, rg_coll_finalize,
};

const ncclTuner_v3_t ncclTunerPlugin_v3 = {
  RG_NET_NAME, rg_tuner_init_v3, rg_tuner_get_coll_info_v3, rg_tuner_finalize,
};

const ncclTuner_v4_t ncclTunerPlugin_v4 = {
  RG_NET_NAME, rg_tuner_init_v4, rg_tuner_get_coll_info, rg_tuner_finalize,
};

const ncclTuner_v5_t ncclTunerPlugin_v5 = {
  RG_NET_NAME, rg_tuner_init_v5, rg_tuner_get_coll_info, rg_tuner_finalize,
};

const ncclTuner_v7_t ncclTunerPlugin_v7 = {
  RG_NET_NAME, rg_tuner_init_v7, rg_tuner_get_coll_info, rg_tuner_finalize, rg_tuner_get_chunk_size,
};

const ncclTuner_v6_t ncclTunerPlugin_v6 = {
  RG_NET_NAME, rg_tuner_init_v6, rg_tuner_get_coll_info, rg_tuner_finalize, rg_tuner_get_chunk_size,
};
*/
import "C"

import (
	_ "github.com/ianlancetaylor/cgosymbolizer" // C frames by name in crash traces

	_ "github.com/roce-gather/roce_gather/plugin"
)

func main() {}
