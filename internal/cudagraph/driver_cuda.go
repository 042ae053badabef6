//go:build cuda

package cudagraph

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>
#include <stdint.h>
#include <stddef.h>

// Handles cross the cgo boundary as uintptr_t and are converted to CUDA
// handle types here, in C, so that Go never turns an integer it received from
// Python into an unsafe.Pointer.
//
// Symbols are named explicitly where the header's macros would otherwise pick
// the binding: cuda.h #defines cuStreamBeginCapture to cuStreamBeginCapture_v2
// (since 10.1) and cuGraphInstantiate to cuGraphInstantiate_v2 (11.x) or
// cuGraphInstantiateWithFlags (12.x+). Naming them keeps one binary's symbols
// the same whichever 11.8-12.x header it was built against.

// gg_ensure_ctx makes the stream's context current on the calling thread when
// the thread has none (a thread torch has not used for CUDA yet). It leaves an
// existing current context alone: switching it under torch's feet would be
// worse than letting the driver report a mismatch. *failed names the call
// that failed.
static CUresult gg_ensure_ctx(uintptr_t s, const char **failed) {
	CUcontext cur = NULL;
	CUresult r = cuCtxGetCurrent(&cur);
	if (r != CUDA_SUCCESS) { *failed = "cuCtxGetCurrent"; return r; }
	if (cur != NULL) return CUDA_SUCCESS;
	CUcontext sctx = NULL;
	r = cuStreamGetCtx((CUstream)s, &sctx);
	if (r != CUDA_SUCCESS) { *failed = "cuStreamGetCtx"; return r; }
	r = cuCtxSetCurrent(sctx);
	if (r != CUDA_SUCCESS) { *failed = "cuCtxSetCurrent"; return r; }
	return CUDA_SUCCESS;
}
static CUresult gg_begin(uintptr_t s, int mode) {
	return cuStreamBeginCapture_v2((CUstream)s, (CUstreamCaptureMode)mode);
}
static CUresult gg_end(uintptr_t s, uintptr_t *graph) {
	CUgraph g = NULL;
	CUresult r = cuStreamEndCapture((CUstream)s, &g);
	*graph = (uintptr_t)g;
	return r;
}
static CUresult gg_instantiate(uintptr_t g, uintptr_t *exec) {
	CUgraphExec e = NULL;
	CUresult r = cuGraphInstantiateWithFlags(&e, (CUgraph)g, 0);
	*exec = (uintptr_t)e;
	return r;
}
static CUresult gg_launch(uintptr_t e, uintptr_t s) { return cuGraphLaunch((CUgraphExec)e, (CUstream)s); }
static CUresult gg_upload(uintptr_t e, uintptr_t s) { return cuGraphUpload((CUgraphExec)e, (CUstream)s); }
static CUresult gg_exec_destroy(uintptr_t e) { return cuGraphExecDestroy((CUgraphExec)e); }
static CUresult gg_graph_destroy(uintptr_t g) { return cuGraphDestroy((CUgraph)g); }
static CUresult gg_is_capturing(uintptr_t s, int *status) {
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult r = cuStreamIsCapturing((CUstream)s, &st);
	*status = (int)st;
	return r;
}
static CUresult gg_exchange_mode(int mode, int *prev) {
	CUstreamCaptureMode m = (CUstreamCaptureMode)mode;
	CUresult r = cuThreadExchangeStreamCaptureMode(&m);
	*prev = (int)m;
	return r;
}
static CUresult gg_node_count(uintptr_t g, size_t *n) {
	*n = 0;
	return cuGraphGetNodes((CUgraph)g, NULL, n);
}
// gg_event_create creates a timing-free event in the context of stream s,
// pushing that context for the call (the calling thread's current context may
// be another device's, or none). *failed names the call that failed.
static CUresult gg_event_create(uintptr_t s, uintptr_t *ev, const char **failed) {
	CUcontext ctx = NULL, popped = NULL;
	CUevent e = NULL;
	*ev = 0;
	CUresult r = cuStreamGetCtx((CUstream)s, &ctx);
	if (r != CUDA_SUCCESS) { *failed = "cuStreamGetCtx"; return r; }
	r = cuCtxPushCurrent(ctx);
	if (r != CUDA_SUCCESS) { *failed = "cuCtxPushCurrent"; return r; }
	r = cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
	CUresult pr = cuCtxPopCurrent(&popped);
	if (r != CUDA_SUCCESS) { *failed = "cuEventCreate"; return r; }
	if (pr != CUDA_SUCCESS) { cuEventDestroy(e); *failed = "cuCtxPopCurrent"; return pr; }
	*ev = (uintptr_t)e;
	return CUDA_SUCCESS;
}
static CUresult gg_event_record(uintptr_t e, uintptr_t s) { return cuEventRecord((CUevent)e, (CUstream)s); }
static CUresult gg_stream_wait_event(uintptr_t s, uintptr_t e) { return cuStreamWaitEvent((CUstream)s, (CUevent)e, 0); }
static CUresult gg_driver_version(int *v) { return cuDriverGetVersion(v); }
// The driver has no name for codes it does not know (or when it cannot be
// asked at all); the Go side then substitutes its own text.
static const char *gg_err_name(int r) {
	const char *s = NULL;
	if (cuGetErrorName((CUresult)r, &s) != CUDA_SUCCESS) return NULL;
	return s;
}
static const char *gg_err_string(int r) {
	const char *s = NULL;
	if (cuGetErrorString((CUresult)r, &s) != CUDA_SUCCESS) return NULL;
	return s;
}
*/
import "C"

import (
	"fmt"
	"reflect"

	"gorgonia.org/cu"
)

// Flavor names this build of the core.
const Flavor = "cuda"

// HeaderVersion is CUDA_VERSION of the cuda.h this package was compiled
// against (e.g. 12090). It can differ from the driver's version.
const HeaderVersion = int(C.CUDA_VERSION)

// NewDriver returns the driver of this build: real CUDA driver calls.
//
// Importing this package runs gorgonia.org/cu's init, which calls cuInit and
// exits the process when it fails; the Python side probes the driver before
// loading the cuda flavor so that never happens inside a user's interpreter.
func NewDriver() Driver { return cudaDriver{} }

// cudaDriver holds no state: the registry owns all bookkeeping, and the CUDA
// driver is itself thread-safe.
type cudaDriver struct{}

// newError builds an *Error for a failed CUresult, asking the driver for the
// code's name and description.
func newError(op string, code int) *Error {
	e := &Error{Op: op, Code: code, Name: "CUDA_ERROR_UNKNOWN_CODE", Message: "unknown CUresult"}
	if s := C.gg_err_name(C.int(code)); s != nil {
		e.Name = C.GoString(s)
	}
	if s := C.gg_err_string(C.int(code)); s != nil {
		e.Message = C.GoString(s)
	}
	return e
}

func check(op string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return newError(op, int(r))
}

// fromCu turns an error returned by gorgonia.org/cu into an *Error. cu's
// error type is an unexported int holding the CUresult, so the code is read
// by reflection; anything else is wrapped unchanged.
func fromCu(op string, err error) error {
	if err == nil {
		return nil
	}
	if v := reflect.ValueOf(err); v.Kind() == reflect.Int {
		return newError(op, int(v.Int()))
	}
	return fmt.Errorf("%s: %w", op, err)
}

func ensureContext(s C.uintptr_t) error {
	var failed *C.char
	if r := C.gg_ensure_ctx(s, &failed); r != C.CUDA_SUCCESS {
		return newError(C.GoString(failed), int(r))
	}
	return nil
}

func (cudaDriver) BeginCapture(stream uintptr, mode Mode) error {
	s := C.uintptr_t(stream)
	if err := ensureContext(s); err != nil {
		return err
	}
	return check("cuStreamBeginCapture", C.gg_begin(s, C.int(mode)))
}

func (cudaDriver) EndCapture(stream uintptr) (RawGraph, error) {
	s := C.uintptr_t(stream)
	if err := ensureContext(s); err != nil {
		return 0, err
	}
	var g C.uintptr_t
	err := check("cuStreamEndCapture", C.gg_end(s, &g))
	return RawGraph(g), err
}

func (cudaDriver) Instantiate(g RawGraph) (RawExec, error) {
	var e C.uintptr_t
	if err := check("cuGraphInstantiateWithFlags", C.gg_instantiate(C.uintptr_t(g), &e)); err != nil {
		return 0, err
	}
	return RawExec(e), nil
}

func (cudaDriver) Launch(e RawExec, stream uintptr) error {
	s := C.uintptr_t(stream)
	// A replay can come from a thread that never touched CUDA (autograd's
	// worker threads do not always have a current context).
	if err := ensureContext(s); err != nil {
		return err
	}
	return check("cuGraphLaunch", C.gg_launch(C.uintptr_t(e), s))
}

func (cudaDriver) Upload(e RawExec, stream uintptr) error {
	s := C.uintptr_t(stream)
	if err := ensureContext(s); err != nil {
		return err
	}
	return check("cuGraphUpload", C.gg_upload(C.uintptr_t(e), s))
}

func (cudaDriver) DestroyExec(e RawExec) error {
	return check("cuGraphExecDestroy", C.gg_exec_destroy(C.uintptr_t(e)))
}

func (cudaDriver) DestroyGraph(g RawGraph) error {
	return check("cuGraphDestroy", C.gg_graph_destroy(C.uintptr_t(g)))
}

func (cudaDriver) IsCapturing(stream uintptr) (CaptureStatus, error) {
	var st C.int
	if err := check("cuStreamIsCapturing", C.gg_is_capturing(C.uintptr_t(stream), &st)); err != nil {
		return StatusNone, err
	}
	return CaptureStatus(st), nil
}

func (cudaDriver) ExchangeMode(mode Mode) (Mode, error) {
	var prev C.int
	if err := check("cuThreadExchangeStreamCaptureMode", C.gg_exchange_mode(C.int(mode), &prev)); err != nil {
		return mode, err
	}
	return Mode(prev), nil
}

func (cudaDriver) NodeCount(g RawGraph) (int, error) {
	var n C.size_t
	if err := check("cuGraphGetNodes", C.gg_node_count(C.uintptr_t(g), &n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

func (cudaDriver) EventCreate(stream uintptr) (RawEvent, error) {
	var e C.uintptr_t
	var failed *C.char
	if r := C.gg_event_create(C.uintptr_t(stream), &e, &failed); r != C.CUDA_SUCCESS {
		return 0, newError(C.GoString(failed), int(r))
	}
	return RawEvent(e), nil
}

func (cudaDriver) EventRecord(ev RawEvent, stream uintptr) error {
	return check("cuEventRecord", C.gg_event_record(C.uintptr_t(ev), C.uintptr_t(stream)))
}

func (cudaDriver) StreamWaitEvent(stream uintptr, ev RawEvent) error {
	return check("cuStreamWaitEvent", C.gg_stream_wait_event(C.uintptr_t(stream), C.uintptr_t(ev)))
}

func (cudaDriver) DriverVersion() (int, error) {
	// cu.Version reports a failure only as -1; ask the driver again for the
	// code so the error says why.
	if v := cu.Version(); v > 0 {
		return v, nil
	}
	var v C.int
	if err := check("cuDriverGetVersion", C.gg_driver_version(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

func (cudaDriver) DeviceCount() (int, error) {
	n, err := cu.NumDevices()
	if err != nil {
		return 0, fromCu("cuDeviceGetCount", err)
	}
	return n, nil
}

func (d cudaDriver) checkOrdinal(ordinal int) error {
	n, err := d.DeviceCount()
	if err != nil {
		return err
	}
	if ordinal < 0 || ordinal >= n {
		return fmt.Errorf("device ordinal %d out of range (%d devices)", ordinal, n)
	}
	return nil
}

func (d cudaDriver) DeviceName(ordinal int) (string, error) {
	// cu.Device is used as a CUdevice directly; for ordinals in range the
	// driver's CUdevice handle equals the ordinal (cuDeviceGet is the identity).
	if err := d.checkOrdinal(ordinal); err != nil {
		return "", err
	}
	name, err := cu.Device(ordinal).Name()
	if err != nil {
		return "", fromCu("cuDeviceGetName", err)
	}
	return name, nil
}

func (d cudaDriver) DeviceTotalMemory(ordinal int) (int64, error) {
	if err := d.checkOrdinal(ordinal); err != nil {
		return 0, err
	}
	n, err := cu.Device(ordinal).TotalMem()
	if err != nil {
		return 0, fromCu("cuDeviceTotalMem", err)
	}
	return n, nil
}
