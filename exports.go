// Command roce_gather is the NCCL plugin library (built with -buildmode=c-shared): the
// versioned ncclNet tables NCCL looks up with dlsym when NCCL_NET_PLUGIN names it, and the
// interceptor's NCCL functions (plugin/intercept.c). Every entry point lives in package
// plugin; this file only assembles the tables.
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

*/
import "C"

import (
	_ "github.com/ianlancetaylor/cgosymbolizer" // C frames by name in crash traces

	_ "github.com/roce-gather/roce_gather/plugin"
)

func main() {}
