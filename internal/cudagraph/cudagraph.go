// Package cudagraph is gograph's capture engine: it begins and ends stream
// capture on streams that PyTorch owns, instantiates the captured CUDA graphs
// and launches, uploads and destroys them through the CUDA driver API.
//
// The package has two layers. A Driver is a thin, stateless binding of the
// driver calls: driver_cuda.go (build tag `cuda`) is the project's own cgo
// against <cuda.h> plus gorgonia.org/cu for device queries, and
// driver_nocuda.go is the cpu flavor whose every call fails with ErrNoCUDA.
// A Registry sits on top of a Driver and owns the policy: which streams are
// capturing through gograph, which instantiated graphs exist, what handle
// each one has, and cleaning up on every failure path so nothing leaks.
// Keeping the policy in pure Go over an interface is what lets it be tested
// without a GPU.
//
// Threading: capture mode and the current CUDA context are per OS thread.
// When Python calls into Go through gopy, the Go code runs on the calling
// Python thread, so every Driver call must be made on the calling goroutine
// (never handed to another goroutine) for thread-local capture and context
// handling to refer to the Python thread that asked.
package cudagraph

import (
	"errors"
	"fmt"
)

// Mode is a stream capture mode (CUstreamCaptureMode).
type Mode int

// Capture modes, with the values of CUstreamCaptureMode.
const (
	ModeGlobal      Mode = 0
	ModeThreadLocal Mode = 1
	ModeRelaxed     Mode = 2
)

// Valid reports whether m is one of the three CUDA capture modes. The value
// crosses into C as a plain int, so anything else must be refused before the
// driver sees it.
func (m Mode) Valid() bool { return m >= ModeGlobal && m <= ModeRelaxed }

func (m Mode) String() string {
	switch m {
	case ModeGlobal:
		return "global"
	case ModeThreadLocal:
		return "thread_local"
	case ModeRelaxed:
		return "relaxed"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// CaptureStatus is a stream's capture status (CUstreamCaptureStatus).
type CaptureStatus int

// Capture statuses, with the values of CUstreamCaptureStatus.
const (
	StatusNone        CaptureStatus = 0
	StatusActive      CaptureStatus = 1
	StatusInvalidated CaptureStatus = 2
)

// RawGraph is a CUgraph as an integer. Handles stay integers on the Go side
// so that Go never holds a C pointer it did not allocate; only the C helpers
// of the cuda driver convert them.
type RawGraph uintptr

// RawExec is a CUgraphExec as an integer (see RawGraph).
type RawExec uintptr

// RawEvent is a CUevent as an integer (see RawGraph).
type RawEvent uintptr

// Driver is the set of CUDA driver calls the capture engine needs. An
// implementation is a stateless binding: it converts arguments, makes the
// call and turns a failing CUresult into an *Error. Streams are the integer
// values of CUstream handles (torch.cuda.Stream.cuda_stream).
type Driver interface {
	// BeginCapture starts capture on stream (cuStreamBeginCapture_v2),
	// first making the stream's context current on the calling thread if
	// that thread has no current context.
	BeginCapture(stream uintptr, mode Mode) error
	// EndCapture ends capture on stream (cuStreamEndCapture). It may return
	// a non-zero graph together with an error; the caller then owns that
	// graph and must destroy it.
	EndCapture(stream uintptr) (RawGraph, error)
	// Instantiate creates an executable graph (cuGraphInstantiateWithFlags).
	Instantiate(g RawGraph) (RawExec, error)
	// Launch enqueues e on stream (cuGraphLaunch).
	Launch(e RawExec, stream uintptr) error
	// Upload uploads e to the device on stream ahead of its first launch
	// (cuGraphUpload).
	Upload(e RawExec, stream uintptr) error
	// DestroyExec frees an executable graph (cuGraphExecDestroy).
	DestroyExec(e RawExec) error
	// DestroyGraph frees a graph (cuGraphDestroy).
	DestroyGraph(g RawGraph) error
	// IsCapturing reports stream's capture status (cuStreamIsCapturing).
	IsCapturing(stream uintptr) (CaptureStatus, error)
	// ExchangeMode sets the calling thread's capture mode and returns the
	// previous one (cuThreadExchangeStreamCaptureMode).
	ExchangeMode(mode Mode) (Mode, error)
	// NodeCount returns how many nodes g has (cuGraphGetNodes).
	NodeCount(g RawGraph) (int, error)
	// EventCreate creates an event without timing in stream's context
	// (cuEventCreate with CU_EVENT_DISABLE_TIMING, that context pushed for
	// the call), whatever context is current on the calling thread.
	EventCreate(stream uintptr) (RawEvent, error)
	// EventRecord records ev on stream (cuEventRecord).
	EventRecord(ev RawEvent, stream uintptr) error
	// StreamWaitEvent makes stream's later work wait for ev's latest record
	// (cuStreamWaitEvent).
	StreamWaitEvent(stream uintptr, ev RawEvent) error

	// DriverVersion returns cuDriverGetVersion, e.g. 13000.
	DriverVersion() (int, error)
	// DeviceCount returns the number of CUDA devices.
	DeviceCount() (int, error)
	// DeviceName returns the name of device ordinal.
	DeviceName(ordinal int) (string, error)
	// DeviceTotalMemory returns the memory of device ordinal in bytes.
	DeviceTotalMemory(ordinal int) (int64, error)
}

// Error is a failed CUDA driver call.
type Error struct {
	Op      string // the driver function, e.g. "cuStreamEndCapture"
	Code    int    // the CUresult value, e.g. 901
	Name    string // the CUresult name, e.g. "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
	Message string // the driver's description of the code
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (%d): %s", e.Op, e.Name, e.Code, e.Message)
}

// CUresult codes that callers branch on. The driver tests and the fake use
// the same values so that errors read alike with and without a GPU.
const (
	CodeInvalidValue             = 1   // CUDA_ERROR_INVALID_VALUE
	CodeIllegalState             = 401 // CUDA_ERROR_ILLEGAL_STATE
	CodeStreamCaptureUnsupported = 900 // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
	CodeStreamCaptureInvalidated = 901 // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
	CodeStreamCaptureWrongThread = 908 // CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
)

// ErrorCode returns the CUresult carried by err (or anything it wraps), or 0
// when err is not a driver error.
func ErrorCode(err error) int {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// ErrNoCUDA is what every driver call returns in the cpu flavor.
var ErrNoCUDA = errors.New("gograph core was built without CUDA support (cpu flavor)")
