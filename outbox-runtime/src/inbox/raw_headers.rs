//! Reading a received message's headers as bytes.
//!
//! rdkafka's header accessor turns each name into `&str` with `unwrap()`, so
//! a message whose header name is not UTF-8 — which any producer can send —
//! panics the consumer's polling thread. This reads the names and values
//! through librdkafka directly, as bytes; the caller decides what a bad name
//! means (a dead letter).

use std::ffi::{CStr, c_char, c_void};

use rdkafka::bindings as rd;
use rdkafka::message::BorrowedMessage;

/// The headers of `message`, in order: `(name, value)` as bytes (a name
/// stops at its first NUL byte, as librdkafka stores it).
#[allow(unsafe_code)]
pub(crate) fn of<'a>(message: &'a BorrowedMessage<'a>) -> Vec<(&'a [u8], Option<&'a [u8]>)> {
    let mut headers: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `message.ptr()` is the live librdkafka message `message` wraps;
    // on success `headers` points into it (owned by the message, valid for
    // as long as `message` is borrowed, never freed here).
    let err = unsafe { rd::rd_kafka_message_headers(message.ptr(), &mut headers) };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || headers.is_null() {
        return Vec::new();
    }
    // SAFETY: `headers` is a valid header list (above).
    let count = unsafe { rd::rd_kafka_header_cnt(headers) };
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const c_char = std::ptr::null();
        let mut value: *const c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `idx < count`; the out-pointers are valid locals.
        let err =
            unsafe { rd::rd_kafka_header_get_all(headers, idx, &mut name, &mut value, &mut size) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            break;
        }
        // SAFETY: librdkafka stores each name NUL-terminated and each value
        // as `size` bytes, both inside the header list, which lives as long
        // as `message` (above).
        let name = unsafe { CStr::from_ptr(name) }.to_bytes();
        let value = (!value.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) });
        out.push((name, value));
    }
    out
}
