//! The one place where errno values and NBD error values meet, in both directions.

use std::io;

use crate::wire::errno;

/// The NBD error value to send for a failed request.
pub fn nbd_error(err: &io::Error) -> u32 {
    if let Some(code) = err.raw_os_error() {
        return match code {
            libc::EPERM | libc::EACCES | libc::EROFS => errno::EPERM,
            libc::ENOSPC | libc::EDQUOT | libc::EFBIG => errno::ENOSPC,
            libc::EINVAL => errno::EINVAL,
            libc::EOVERFLOW => errno::EOVERFLOW,
            libc::ENOTSUP | libc::ENOSYS => errno::ENOTSUP,
            libc::ENOMEM => errno::ENOMEM,
            libc::ESHUTDOWN => errno::ESHUTDOWN,
            _ => errno::EIO,
        };
    }
    match err.kind() {
        io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => errno::EPERM,
        io::ErrorKind::StorageFull | io::ErrorKind::FileTooLarge | io::ErrorKind::QuotaExceeded => {
            errno::ENOSPC
        }
        io::ErrorKind::InvalidInput => errno::EINVAL,
        io::ErrorKind::Unsupported => errno::ENOTSUP,
        io::ErrorKind::OutOfMemory => errno::ENOMEM,
        _ => errno::EIO,
    }
}

/// The `io::Error` a client reports for an NBD error value received from a server.
pub fn io_error(nbd: u32) -> io::Error {
    let code = match nbd {
        errno::EPERM => libc::EPERM,
        errno::ENOSPC => libc::ENOSPC,
        errno::EINVAL => libc::EINVAL,
        errno::EOVERFLOW => libc::EOVERFLOW,
        errno::ENOTSUP => libc::ENOTSUP,
        errno::ENOMEM => libc::ENOMEM,
        errno::ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EIO,
    };
    io::Error::from_raw_os_error(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_the_specs_values() {
        let cases = [
            (libc::EPERM, errno::EPERM),
            (libc::EROFS, errno::EPERM),
            (libc::EIO, errno::EIO),
            (libc::ENOSPC, errno::ENOSPC),
            (libc::EDQUOT, errno::ENOSPC),
            (libc::EFBIG, errno::ENOSPC),
            (libc::EINVAL, errno::EINVAL),
            (libc::EOVERFLOW, errno::EOVERFLOW),
            (libc::EOPNOTSUPP, errno::ENOTSUP),
            (libc::ENOMEM, errno::ENOMEM),
            (libc::ESHUTDOWN, errno::ESHUTDOWN),
            (libc::EBADF, errno::EIO),
        ];
        for (os, nbd) in cases {
            assert_eq!(
                nbd_error(&io::Error::from_raw_os_error(os)),
                nbd,
                "errno {os}"
            );
        }
        assert_eq!(
            nbd_error(&io::Error::new(io::ErrorKind::Unsupported, "x")),
            errno::ENOTSUP
        );
        assert_eq!(
            nbd_error(&io::Error::new(io::ErrorKind::UnexpectedEof, "x")),
            errno::EIO
        );
    }

    #[test]
    fn roundtrip_through_the_wire() {
        for nbd in [
            errno::EPERM,
            errno::EIO,
            errno::ENOMEM,
            errno::EINVAL,
            errno::ENOSPC,
            errno::EOVERFLOW,
            errno::ENOTSUP,
            errno::ESHUTDOWN,
        ] {
            assert_eq!(nbd_error(&io_error(nbd)), nbd);
        }
        assert_eq!(io_error(9999).raw_os_error(), Some(libc::EIO));
    }
}
