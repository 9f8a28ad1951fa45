package verbs

/*
#cgo CFLAGS: -O2 -Wall -Wextra -Werror
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "ibv.h"
*/
import "C"

import (
	"fmt"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Values from verbs.h that the pure Go parts use.
const (
	qpStateInit = C.IBV_QPS_INIT
	qpStateRTR  = C.IBV_QPS_RTR
	qpStateRTS  = C.IBV_QPS_RTS

	maskState           = C.IBV_QP_STATE
	maskAccessFlags     = C.IBV_QP_ACCESS_FLAGS
	maskPKeyIndex       = C.IBV_QP_PKEY_INDEX
	maskPort            = C.IBV_QP_PORT
	maskAV              = C.IBV_QP_AV
	maskPathMTU         = C.IBV_QP_PATH_MTU
	maskTimeout         = C.IBV_QP_TIMEOUT
	maskRetryCnt        = C.IBV_QP_RETRY_CNT
	maskRNRRetry        = C.IBV_QP_RNR_RETRY
	maskRQPSN           = C.IBV_QP_RQ_PSN
	maskMaxQPRdAtomic   = C.IBV_QP_MAX_QP_RD_ATOMIC
	maskMinRNRTimer     = C.IBV_QP_MIN_RNR_TIMER
	maskSQPSN           = C.IBV_QP_SQ_PSN
	maskMaxDestRdAtomic = C.IBV_QP_MAX_DEST_RD_ATOMIC
	maskDestQPN         = C.IBV_QP_DEST_QPN

	accessLocalWrite  = C.IBV_ACCESS_LOCAL_WRITE
	accessRemoteWrite = C.IBV_ACCESS_REMOTE_WRITE

	mtu256  = C.IBV_MTU_256
	mtu1024 = C.IBV_MTU_1024
	mtu4096 = C.IBV_MTU_4096

	portDown   = C.IBV_PORT_DOWN
	portActive = C.IBV_PORT_ACTIVE

	linkUnspecified = C.IBV_LINK_LAYER_UNSPECIFIED
	linkIB          = C.IBV_LINK_LAYER_INFINIBAND
	linkEthernet    = C.IBV_LINK_LAYER_ETHERNET
)

// load opens libibverbs once; its absence wraps fabric.ErrUnavailable.
func load() error {
	if C.rg_ibv_load() != 0 {
		return fmt.Errorf("%w: %s", fabric.ErrUnavailable, C.GoString(C.rg_ibv_error()))
	}
	return nil
}

// toC fills struct ibv_qp_attr; the fields Mask does not name stay zero.
func (a qpAttr) toC() (C.struct_ibv_qp_attr, C.int) {
	var c C.struct_ibv_qp_attr
	c.qp_state = C.enum_ibv_qp_state(a.State)
	c.port_num = C.uint8_t(a.Port)
	c.qp_access_flags = C.uint(a.Access)
	c.path_mtu = C.enum_ibv_mtu(a.PathMTU)
	c.dest_qp_num = C.uint32_t(a.DestQPN)
	c.max_dest_rd_atomic = C.uint8_t(a.MaxDestRdAtomic)
	c.max_rd_atomic = C.uint8_t(a.MaxRdAtomic)
	c.min_rnr_timer = C.uint8_t(a.MinRNRTimer)
	c.timeout = C.uint8_t(a.Timeout)
	c.retry_cnt = C.uint8_t(a.RetryCnt)
	c.rnr_retry = C.uint8_t(a.RNRRetry)
	ah := &c.ah_attr
	ah.dlid = C.uint16_t(a.AH.DLID)
	ah.port_num = C.uint8_t(a.AH.Port)
	if a.AH.IsGlobal {
		ah.is_global = 1
		ah.grh.dgid = a.AH.DGID
		ah.grh.sgid_index = C.uint8_t(a.AH.SGIDIndex)
		ah.grh.hop_limit = C.uint8_t(a.AH.HopLimit)
	}
	return c, C.int(a.Mask)
}

// viaC passes a through struct ibv_qp_attr and back, so tests can see what ibv_modify_qp gets.
func (a qpAttr) viaC() qpAttr {
	c, mask := a.toC()
	ah := c.ah_attr
	return qpAttr{
		Mask: int(mask), State: int(c.qp_state), Port: uint8(c.port_num), Access: int(c.qp_access_flags),
		PathMTU: int(c.path_mtu), DestQPN: uint32(c.dest_qp_num), MaxDestRdAtomic: uint8(c.max_dest_rd_atomic),
		MaxRdAtomic: uint8(c.max_rd_atomic), MinRNRTimer: uint8(c.min_rnr_timer), Timeout: uint8(c.timeout),
		RetryCnt: uint8(c.retry_cnt), RNRRetry: uint8(c.rnr_retry),
		AH: ahAttr{IsGlobal: ah.is_global != 0, DLID: uint16(ah.dlid), Port: uint8(ah.port_num),
			DGID: ah.grh.dgid, SGIDIndex: uint8(ah.grh.sgid_index), HopLimit: uint8(ah.grh.hop_limit)},
	}
}

// modifyQP applies one state transition; what names it in the error.
func modifyQP(qp *C.struct_ibv_qp, a qpAttr, what string) error {
	c, mask := a.toC()
	if rc := C.rg_ibv_modify_qp(qp, &c, mask); rc != 0 {
		return fmt.Errorf("ibv_modify_qp to %s (mask 0x%x) failed: %v (errno %d)", what, int(mask), errnoErr(int(rc)), int(rc))
	}
	return nil
}
