package gograph

// Build and driver information.

import "github.com/gograph/gograph/internal/cudagraph"

// CoreVersion returns the semver of the core, e.g. "0.3.0".
func CoreVersion() string { return coreVersion }

// Flavor returns "cpu" or "cuda": which build of the core this is.
func Flavor() string { return cudagraph.Flavor }

// CudaHeaderVersion returns CUDA_VERSION of the cuda.h the core was compiled
// against (0 in the cpu flavor).
func CudaHeaderVersion() int { return cudagraph.HeaderVersion }

// DriverVersion returns the CUDA driver's version (cuDriverGetVersion, e.g. 13000).
func DriverVersion() (v int, err error) {
	defer recoverPanic("driver_version", &err)
	v, err = graphs.Driver().DriverVersion()
	return v, opErr("driver_version", err)
}

// DeviceCount returns the number of CUDA devices.
func DeviceCount() (n int, err error) {
	defer recoverPanic("device_count", &err)
	n, err = graphs.Driver().DeviceCount()
	return n, opErr("device_count", err)
}

// DeviceName returns the name of device ordinal.
func DeviceName(ordinal int) (name string, err error) {
	defer recoverPanic("device_name", &err)
	name, err = graphs.Driver().DeviceName(ordinal)
	return name, opErr("device_name", err)
}

// DeviceTotalMemory returns the memory of device ordinal in bytes.
func DeviceTotalMemory(ordinal int) (bytes int64, err error) {
	defer recoverPanic("device_total_memory", &err)
	bytes, err = graphs.Driver().DeviceTotalMemory(ordinal)
	return bytes, opErr("device_total_memory", err)
}

// TriggerPanicForTest panics inside Go, to prove a panic comes back to Python
// as a RuntimeError instead of aborting the interpreter.
func TriggerPanicForTest() (ok bool, err error) {
	defer recoverPanic("trigger_panic_for_test", &err)
	panic("deliberate panic for testing the boundary")
}
