//go:build !cuda

package cudagraph

// Flavor names this build of the core.
const Flavor = "cpu"

// HeaderVersion is 0: the cpu flavor is compiled without cuda.h.
const HeaderVersion = 0

// NewDriver returns the driver of this build. The cpu flavor links no CUDA at
// all (so it loads on any machine); every call fails with ErrNoCUDA, which
// the Python side turns into a clear "CUDA features need the cuda flavor"
// error while the eager engine keeps working.
func NewDriver() Driver { return noCUDA{} }

type noCUDA struct{}

func (noCUDA) BeginCapture(uintptr, Mode) error           { return ErrNoCUDA }
func (noCUDA) EndCapture(uintptr) (RawGraph, error)       { return 0, ErrNoCUDA }
func (noCUDA) Instantiate(RawGraph) (RawExec, error)      { return 0, ErrNoCUDA }
func (noCUDA) Launch(RawExec, uintptr) error              { return ErrNoCUDA }
func (noCUDA) Upload(RawExec, uintptr) error              { return ErrNoCUDA }
func (noCUDA) DestroyExec(RawExec) error                  { return ErrNoCUDA }
func (noCUDA) DestroyGraph(RawGraph) error                { return ErrNoCUDA }
func (noCUDA) IsCapturing(uintptr) (CaptureStatus, error) { return StatusNone, ErrNoCUDA }
func (noCUDA) ExchangeMode(m Mode) (Mode, error)          { return m, ErrNoCUDA }
func (noCUDA) NodeCount(RawGraph) (int, error)            { return 0, ErrNoCUDA }
func (noCUDA) EventCreate(uintptr) (RawEvent, error)      { return 0, ErrNoCUDA }
func (noCUDA) EventRecord(RawEvent, uintptr) error        { return ErrNoCUDA }
func (noCUDA) StreamWaitEvent(uintptr, RawEvent) error    { return ErrNoCUDA }
func (noCUDA) DriverVersion() (int, error)                { return 0, ErrNoCUDA }
func (noCUDA) DeviceCount() (int, error)                  { return 0, ErrNoCUDA }
func (noCUDA) DeviceName(int) (string, error)             { return "", ErrNoCUDA }
func (noCUDA) DeviceTotalMemory(int) (int64, error)       { return 0, ErrNoCUDA }
